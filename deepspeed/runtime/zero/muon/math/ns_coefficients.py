"""Newton-Schulz coefficient schedules: the odd quintic p_k(x) = a_k x + b_k x^3 + c_k x^5 that step k applies to
every singular value (``optimizer.params.ns_coefficients``).

- "jordan" (the default): Keller Jordan's quintic (3.4445, -4.7750, 2.0315) at every step. It pushes singular
  values in [1e-3, 1] into roughly [0.47, 1.20] within five steps: fast, not orthogonal.
- "polar_express": the Polar Express schedule (Amsel, Persson, Musco and Gower, "The Polar Express: Optimal Matrix
  Sign Methods and Their Application to the Muon Algorithm", 2025). Step k's quintic is the minimax-optimal odd
  quintic on the interval the singular values occupy after step k - 1, so five steps map [1e-3, 1] into about
  [0.86, 1.14] at the same cost per step. Computed here from the paper's construction (below); for five steps
  it reproduces the coefficients published with it to rounding (tests/unit/ops/muon/math/test_ns_coefficients.py).

The construction, per step: take the interval [l, u] the singular values lie in (at first [1e-3, 1]: Muon scales
its input to unit Frobenius norm, so none exceeds 1), find the odd quintic minimising max |1 - p(x)| over
[max(l, cushion u), u] by the Remez exchange, rescale it so that 1 - p(l) = p(u) - 1, and stretch it by the safety
factor (p(x) -> p(x / (1 + safety))) so that a value rounded slightly above u still maps below the next step's
bound; the last step is not stretched. The next interval is [p(l), 2 - p(l)]. The cushion keeps the first steps
from trusting singular values as small as l, which bf16 rounding does not resolve.
"""

from __future__ import annotations

import functools
import math

from deepspeed.runtime.constants import MUON_NS_COEFFICIENTS as NS_COEFFICIENT_SCHEDULES

Coefficients = tuple[float, float, float]

# Keller Jordan's Muon quintic.
NS_COEFFICIENTS: Coefficients = (3.4445, -4.7750, 2.0315)

DEFAULT_NS_COEFFICIENTS = "jordan"

# The Polar Express paper's settings for Muon: the smallest singular value the schedule is built for (relative to
# the largest), the cushion and the safety factor.
POLAR_EXPRESS_LOWER_BOUND = 1e-3
POLAR_EXPRESS_CUSHION = 0.02
POLAR_EXPRESS_SAFETY = 0.02

_REMEZ_MAX_ROUNDS = 100


def check_ns_coefficients(name: object) -> None:
    """Raise ValueError unless ``name`` is one of :data:`NS_COEFFICIENT_SCHEDULES`."""
    if not isinstance(name, str) or name not in NS_COEFFICIENT_SCHEDULES:
        raise ValueError(f"ns_coefficients must be one of {list(NS_COEFFICIENT_SCHEDULES)}, got {name!r}")


@functools.cache
def coefficient_schedule(name: str, steps: int) -> tuple[Coefficients, ...]:
    """The (a, b, c) of each of ``steps`` Newton-Schulz steps under the schedule ``name``.

    Raises:
        ValueError: an unknown ``name``, or ``steps`` < 0.
    """
    check_ns_coefficients(name)
    if steps < 0:
        raise ValueError(f"a Newton-Schulz step count must be >= 0, got {steps}")
    if name == "jordan":
        return (NS_COEFFICIENTS, ) * steps
    return polar_express_coefficients(steps)


def quintic(coefficients: Coefficients, x: float) -> float:
    a, b, c = coefficients
    return a * x + b * x**3 + c * x**5


@functools.cache
def polar_express_coefficients(steps: int, lower: float = POLAR_EXPRESS_LOWER_BOUND,
                               cushion: float = POLAR_EXPRESS_CUSHION,
                               safety: float = POLAR_EXPRESS_SAFETY) -> tuple[Coefficients, ...]:
    """The Polar Express schedule for ``steps`` steps (see the module docstring)."""
    schedule = []
    upper = 1.0
    for step in range(steps):
        a, b, c = optimal_odd_quintic(max(lower, cushion * upper), upper)
        # Recentred on [lower, upper]: the cushioned fit is centred on its own, narrower interval.
        rescale = 2 / (quintic((a, b, c), lower) + quintic((a, b, c), upper))
        a, b, c = a * rescale, b * rescale, c * rescale
        if step + 1 < steps:
            stretch = 1 + safety
            a, b, c = a / stretch, b / stretch**3, c / stretch**5
        schedule.append((a, b, c))
        lower = quintic((a, b, c), lower)
        upper = 2 - lower
    return tuple(schedule)


def optimal_odd_quintic(lower: float, upper: float) -> Coefficients:
    """The odd quintic minimising max |1 - p(x)| over [lower, upper] (0 < lower <= upper), by the Remez exchange.

    The optimum equioscillates: 1 - p takes its extreme value E with alternating signs at lower, the two interior
    extrema q < r of p, and upper. Each round solves for (a, b, c, E) through the four current points, then moves
    q and r to the new polynomial's critical points (the roots of p'(x) = a + 3 b x^2 + 5 c x^4).
    """
    if not 0 < lower <= upper:
        raise ValueError(f"the interval must satisfy 0 < lower <= upper, got [{lower}, {upper}]")
    if lower / upper >= 1 - 5e-6:
        # Numerically a point: the Newton-Schulz quintic for an interval around `upper`.
        return 15 / 8 / upper, -10 / 8 / upper**3, 3 / 8 / upper**5
    q, r = (3 * lower + upper) / 4, (lower + 3 * upper) / 4
    error, previous = math.inf, None
    for _ in range(_REMEZ_MAX_ROUNDS):
        rows = [[x, x**3, x**5, sign] for x, sign in ((lower, 1.0), (q, -1.0), (r, 1.0), (upper, -1.0))]
        a, b, c, error = _solve(rows, [1.0, 1.0, 1.0, 1.0])
        if previous is not None and abs(previous - error) <= 1e-15:
            break
        previous = error
        root = math.sqrt(9 * b * b - 20 * a * c)
        q, r = math.sqrt((-3 * b - root) / (10 * c)), math.sqrt((-3 * b + root) / (10 * c))
    return a, b, c


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Solve a small dense linear system by Gaussian elimination with partial pivoting."""
    n = len(rhs)
    rows = [list(row) + [value] for row, value in zip(matrix, rhs)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda i: abs(rows[i][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for i in range(col + 1, n):
            factor = rows[i][col] / rows[col][col]
            for j in range(col, n + 1):
                rows[i][j] -= factor * rows[col][j]
    solution = [0.0] * n
    for i in reversed(range(n)):
        solution[i] = (rows[i][n] - sum(rows[i][j] * solution[j] for j in range(i + 1, n))) / rows[i][i]
    return solution
