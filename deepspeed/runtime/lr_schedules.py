"""DeepSpeed's learning-rate schedules: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest.

Each schedule is a function of ``last_batch_iteration`` (the number of applied optimizer steps minus one) that it
writes into every param group's ``lr``. The engine calls ``step()`` once per applied optimizer step, never on a
step skipped for overflow. The config's ``scheduler.type`` names a class here, else one in
``torch.optim.lr_scheduler``.

Param groups keep their lr split. A learning-rate argument (``warmup_max_lr``, ``cycle_min_lr``, ...) is either
one value per param group, written as given, or a single value. A single value is the schedule of the *reference
lr* and every group follows it in proportion to its own base lr (its ``lr`` when the schedule was built):
``group value = value * base_lr / reference_lr``. When every group has the same base lr that is the reference (each
group gets the value itself, upstream's behaviour). Otherwise the reference is the optimizer's ``defaults['lr']``
(the lr given to a torch optimizer's constructor; ``optimizer.params.lr`` for Muon), which must be one of the
groups' base lrs. So with Muon ``lr`` 3e-4, ``muon_lr`` 0.02 and a scalar ``warmup_max_lr`` 3e-4 (what the Hugging
Face Trainer writes for "auto"), the Adam group warms up to 3e-4 and the Muon group to 0.02. A non-zero single
value that no reference can place is refused with a ValueError naming the argument; upstream wrote it into every
group, silently training groups configured apart at one lr.
"""

import logging
import math
import numbers
from collections.abc import Sequence
from typing import Any

from torch.optim import Optimizer

# The same logger object as deepspeed.utils.logger (upstream's name); looked up by name so this module does not
# depend on the utils package.
logger = logging.getLogger("DeepSpeed")

LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"

NOT_STARTED_WARNING = "Attempting to get learning rate from scheduler before it has started"

PerGroup = float | Sequence[float]


def get_torch_optimizer(optimizer: Any) -> Optimizer:
    """Return the torch optimizer whose param groups a schedule writes.

    Args:
        optimizer: a ``torch.optim.Optimizer``, or a wrapper (such as the ZeRO optimizer) whose ``.optimizer`` is
            one; the wrapper's param groups are the inner optimizer's.

    Raises:
        TypeError: if neither ``optimizer`` nor its ``.optimizer`` is a ``torch.optim.Optimizer``.
    """
    if isinstance(optimizer, Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, Optimizer):
        return inner
    raise TypeError(f"{type(optimizer).__name__} is not a subclass of torch.optim.Optimizer")


def _reference_lr(optimizer: Optimizer, base_lrs: list[float]) -> float | None:
    """The lr a single schedule value stands for (see the module docstring), or None when none can be named."""
    if len(set(base_lrs)) <= 1:
        return base_lrs[0] if base_lrs else None
    reference = optimizer.defaults.get("lr")
    if isinstance(reference, numbers.Real) and any(math.isclose(reference, lr) for lr in base_lrs):
        return float(reference)
    return None


def _per_group(value: PerGroup, base_lrs: list[float], reference: float | None, name: str) -> list[float]:
    """One value per param group: a list as given, a single value scaled by each group's base lr (module docstring).

    Raises:
        ValueError: if a list or tuple does not have one value per param group, or a non-zero single value is given
            while the groups' base lrs differ and no reference lr is known.
    """
    num_groups = len(base_lrs)
    if isinstance(value, (list, tuple)):
        if len(value) != num_groups:
            raise ValueError(f"expected {num_groups} values for {name} (one per param group), got {len(value)}")
        return list(value)
    if len(set(base_lrs)) <= 1 or value == 0:
        return [value] * num_groups
    if reference is None or reference == 0:
        raise ValueError(
            f"{name} is a single value ({value!r}) but the param groups have different learning rates {base_lrs} "
            "and no reference lr says which group it is for: give one value per param group, or set the "
            "optimizer's lr (optimizer.params.lr) to the group lr this value scales"
        )
    return [value * base_lr / reference for base_lr in base_lrs]


def _check_warmup_num_steps(warmup_num_steps: int) -> int:
    """Return ``max(2, warmup_num_steps)``; 2 keeps ``log(warmup_num_steps)`` a non-zero divisor.

    Raises:
        ValueError: if ``warmup_num_steps`` is not a positive integer.
    """
    if (
        not isinstance(warmup_num_steps, numbers.Integral)
        or isinstance(warmup_num_steps, bool)
        or warmup_num_steps <= 0
    ):
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    return max(2, int(warmup_num_steps))


def _check_warmup_type(warmup_type: str) -> str:
    """Return ``warmup_type`` if known, else warn and fall back to log warmup (upstream's behaviour)."""
    if warmup_type in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
        return warmup_type
    logger.warning(f"Using unknown warmup_type: {warmup_type}. The increasing function is set to default (log)")
    return WARMUP_LOG_RATE


def _warmup_gamma(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Warmup progress in [0, 1): ln(it+1)/ln(N) (log) or it/N (linear), for ``0 <= iteration < N``."""
    if warmup_type == WARMUP_LOG_RATE:
        return math.log(iteration + 1) / math.log(warmup_num_steps)
    return iteration / warmup_num_steps


class _BatchSchedule:
    """What every schedule shares: the optimizer, the iteration counter, step and state.

    Args:
        optimizer: a torch optimizer or a wrapper with ``.optimizer`` (see ``get_torch_optimizer``).
        last_batch_iteration: the iteration of the last applied step; -1 before training.

    Raises:
        TypeError: if ``optimizer`` is not a torch optimizer or a wrapper of one.
    """

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        self.optimizer = get_torch_optimizer(optimizer)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] | None = None
        # Read before any schedule writes the groups' lr: a single schedule value scales these.
        self.base_lrs = [group["lr"] for group in self.optimizer.param_groups]
        self.reference_lr = _reference_lr(self.optimizer, self.base_lrs)
        # name -> the value as configured (scalar or list); expanded per group by _group_values.
        self._configured: dict[str, PerGroup] = {}

    @property
    def _num_groups(self) -> int:
        return len(self.optimizer.param_groups)

    def _configure(self, name: str, value: PerGroup) -> list[float]:
        """Keep a learning-rate argument as given and return it per group (checked now, so bad input fails here)."""
        self._configured[name] = value
        return self._group_values(name)

    def _group_values(self, name: str) -> list[float]:
        """The configured argument ``name``, one value per param group, from the current base lrs."""
        return _per_group(self._configured[name], self.base_lrs, self.reference_lr, name)

    def get_lr(self) -> list[float]:
        """Return the learning rate of each param group at ``last_batch_iteration``."""
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        """Return the learning rates last written into the optimizer.

        Raises:
            AssertionError: "need to call step() first" if nothing was written yet (upstream's type and text).
        """
        if self._last_lr is None:
            raise AssertionError("need to call step() first")
        return self._last_lr

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to ``last_batch_iteration`` (default: the next one) and write its learning rates.

        Args:
            last_batch_iteration: the iteration to move to; ``None`` means ``self.last_batch_iteration + 1``.
        """
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply()

    def _apply(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.get_lr(), strict=True):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """Return ``last_batch_iteration`` and the groups' lr split; everything else is configuration.

        The split (``base_lrs``, each group's lr when the schedule was built, and ``reference_lr``) is saved so that a
        resumed schedule scales each group exactly as the uninterrupted one, whatever lrs the groups hold on load.
        """
        return {"last_batch_iteration": self.last_batch_iteration, "base_lrs": list(self.base_lrs),
                "reference_lr": self.reference_lr}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``last_batch_iteration`` and the lr split; the next ``step()`` continues from it.

        Args:
            state_dict: what :meth:`state_dict` returned; upstream's ``{'last_batch_iteration': n}`` is accepted too
                and keeps the split this schedule was built with.

        Raises:
            ValueError: if the dict lacks ``last_batch_iteration``, has other keys, has only one of ``base_lrs``
                and ``reference_lr``, or its ``base_lrs`` does not have one lr per param group.
        """
        split = {"base_lrs", "reference_lr"}
        allowed = {"last_batch_iteration"} | split
        given = set(state_dict)
        if "last_batch_iteration" not in given or not given <= allowed or 0 < len(given & split) < 2:
            missing = sorted(({"last_batch_iteration"} | (split if given & split else set())) - given)
            unexpected = sorted(given - allowed)
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: missing keys {missing}, unexpected keys {unexpected}"
            )
        if given & split:
            base_lrs = [float(lr) for lr in state_dict["base_lrs"]]
            if len(base_lrs) != self._num_groups:
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict: base_lrs has {len(base_lrs)} values but the optimizer "
                    f"has {self._num_groups} param groups"
                )
            reference = state_dict["reference_lr"]
            self.base_lrs, self.reference_lr = base_lrs, None if reference is None else float(reference)
        self.last_batch_iteration = state_dict["last_batch_iteration"]


class LRRangeTest(_BatchSchedule):
    """Grow the learning rate from ``lr_range_test_min_lr`` to find a good maximum.

    lr = min_lr * (1 + step_rate * interval), interval = (it + 1) / step_size, floored with ``staircase``.

    Args:
        optimizer: a torch optimizer or a wrapper with ``.optimizer``.
        lr_range_test_min_lr: the starting learning rate (scalar or one per param group).
        lr_range_test_step_size: iterations per interval.
        lr_range_test_step_rate: the learning-rate increase per interval, as a multiple of ``min_lr``.
        lr_range_test_staircase: grow in steps at whole intervals instead of continuously.
        last_batch_iteration: the iteration of the last applied step; -1 writes ``min_lr`` now.

    Raises:
        TypeError: if ``optimizer`` is not a torch optimizer or a wrapper of one.
        ValueError: if a per-group list has the wrong length or ``lr_range_test_step_size`` <= 0.
    """

    def __init__(
        self,
        optimizer: Any,
        lr_range_test_min_lr: PerGroup = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if not lr_range_test_step_size > 0:
            raise ValueError(f"lr_range_test_step_size must be > 0, got {lr_range_test_step_size!r}")
        self._configure("lr_range_test_min_lr", lr_range_test_min_lr)
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        if last_batch_iteration == -1:
            self._apply()

    def _interval(self) -> float:
        interval = (self.last_batch_iteration + 1) / self.step_size
        return math.floor(interval) if self.staircase else interval

    def get_lr(self) -> list[float]:
        """Return ``min_lr * (1 + step_rate * interval)`` for each param group."""
        increase = 1 + self.step_rate * self._interval()
        return [min_lr * increase for min_lr in self.min_lr]

    @property
    def min_lr(self) -> list[float]:
        return self._group_values("lr_range_test_min_lr")


class OneCycle(_BatchSchedule):
    """The 1Cycle policy: lr up then down over one cycle (momentum the reverse), then an optional decay.

    With scale s the position within the cycle (0 at the ends, 1 at the peak after ``cycle_first_step_size``
    iterations): lr = min_lr + (max_lr - min_lr) * s and beta1 = max_mom - (max_mom - min_mom) * s. After the cycle
    (``it >= total``, d = it - total + 1): lr = min_lr / (1 + decay_lr_rate * d / decay_step_size) and
    beta1 = max_mom * (1 + decay_mom_rate * d / decay_step_size); no decay when ``decay_step_size`` or the rate is 0.
    Momentum is written into ``param_group['betas'][0]`` (each group's beta2 is kept), and only for optimizers
    whose defaults have ``betas``. The stair counts are accepted for config compatibility; as upstream, they do
    not shape the cycle.

    Args:
        optimizer: a torch optimizer or a wrapper with ``.optimizer``.
        cycle_min_lr: the learning rate at both ends of the cycle.
        cycle_max_lr: the learning rate at the peak.
        decay_lr_rate: the learning-rate decay rate after the cycle.
        cycle_first_step_size: iterations of the rising half.
        cycle_second_step_size: iterations of the falling half; ``None`` means ``cycle_first_step_size``.
        cycle_first_stair_count: stairs of the rising half (unused, see above).
        cycle_second_stair_count: stairs of the falling half (unused, see above).
        decay_step_size: iterations per decay interval after the cycle; 0 disables decay.
        cycle_momentum: also cycle beta1.
        cycle_min_mom: beta1 at the peak.
        cycle_max_mom: beta1 at both ends of the cycle.
        decay_mom_rate: the momentum growth rate after the cycle.
        last_batch_iteration: the iteration of the last applied step; -1 writes the iteration-0 values now.

    Raises:
        TypeError: if ``optimizer`` is not a torch optimizer or a wrapper of one.
        ValueError: if ``cycle_first_step_size`` <= 0 or ``cycle_second_step_size`` < 0.
    """

    def __init__(
        self,
        optimizer: Any,
        cycle_min_lr: PerGroup,
        cycle_max_lr: PerGroup,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if not cycle_first_step_size > 0:
            raise ValueError(f"cycle_first_step_size must be > 0, got {cycle_first_step_size!r}")
        if cycle_second_step_size is None:
            cycle_second_step_size = cycle_first_step_size
        if not cycle_second_step_size >= 0:
            raise ValueError(f"cycle_second_step_size must be >= 0, got {cycle_second_step_size!r}")
        self.total_size = float(cycle_first_step_size + cycle_second_step_size)
        self.step_ratio = cycle_first_step_size / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        self._configure("cycle_min_lr", cycle_min_lr)
        self._configure("cycle_max_lr", cycle_max_lr)
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = math.isclose(decay_step_size, 0) or math.isclose(decay_lr_rate, 0)
        self.cycle_momentum = cycle_momentum and self._supports_betas()
        self.min_mom = cycle_min_mom
        self.max_mom = cycle_max_mom
        self.decay_mom_rate = decay_mom_rate
        self.skip_mom_decay = math.isclose(decay_step_size, 0) or math.isclose(decay_mom_rate, 0)
        if last_batch_iteration == -1:
            self._apply()

    @property
    def min_lrs(self) -> list[float]:
        return self._group_values("cycle_min_lr")

    @property
    def max_lrs(self) -> list[float]:
        return self._group_values("cycle_max_lr")

    def _supports_betas(self) -> bool:
        if "betas" in self.optimizer.defaults:
            return True
        logger.warning(
            f"cycle_momentum is disabled because optimizer {type(self.optimizer).__name__} does not "
            "support momentum, no betas attribute in defaults"
        )
        return False

    def _scale_factor(self) -> float:
        """Position within the current cycle: rises 0 -> 1 over the first half, falls 1 -> 0 over the second."""
        batch_iteration = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1.0 + batch_iteration / self.total_size - cycle
        if x <= self.step_ratio:
            return x / self.step_ratio
        return (x - 1) / (self.step_ratio - 1)

    def _decay_interval(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        """Return the learning rate of each param group at ``last_batch_iteration``."""
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        decay = 1 + self.decay_lr_rate * self._decay_interval()
        return [lo / decay for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """Return each group's ``betas`` at ``last_batch_iteration``, or ``None`` when momentum is not cycled."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            beta1 = self.max_mom - (self.max_mom - self.min_mom) * self._scale_factor()
        elif self.skip_mom_decay:
            beta1 = self.max_mom
        else:
            beta1 = self.max_mom * (1 + self.decay_mom_rate * self._decay_interval())
        return [(beta1, group["betas"][1]) for group in self.optimizer.param_groups]

    def _apply(self) -> None:
        super()._apply()
        momentums = self.get_mom()
        if momentums is not None:
            for group, betas in zip(self.optimizer.param_groups, momentums, strict=True):
                group["betas"] = betas


class WarmupLR(_BatchSchedule):
    """Warm the learning rate up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold it.

    gamma = ln(it + 1) / ln(N) (log) or it / N (linear) while it < N, else 1; lr = min + (max - min) * gamma,
    with N = max(2, warmup_num_steps). Before the first step (it = -1) lr = min.

    Args:
        optimizer: a torch optimizer or a wrapper with ``.optimizer``.
        warmup_min_lr: the starting learning rate (scalar or one per param group).
        warmup_max_lr: the learning rate after warmup; ``None`` means each group's current ``lr``.
        warmup_num_steps: warmup iterations.
        warmup_type: 'log' or 'linear'; anything else warns and uses 'log'.
        last_batch_iteration: the iteration of the last applied step; -1 writes ``warmup_min_lr`` now.

    Raises:
        TypeError: if ``optimizer`` is not a torch optimizer or a wrapper of one.
        ValueError: if ``warmup_num_steps`` is not a positive integer or a per-group list has the wrong length.
    """

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: PerGroup = 0.0,
        warmup_max_lr: PerGroup | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self._configure("warmup_min_lr", warmup_min_lr)
        self._max_from_groups = warmup_max_lr is None
        if not self._max_from_groups:
            self._configure("warmup_max_lr", warmup_max_lr)
        self.warmup_num_steps = _check_warmup_num_steps(warmup_num_steps)
        self.warmup_type = _check_warmup_type(warmup_type)
        if last_batch_iteration == -1:
            self._apply()

    @property
    def min_lrs(self) -> list[float]:
        return self._group_values("warmup_min_lr")

    @property
    def max_lrs(self) -> list[float]:
        return list(self.base_lrs) if self._max_from_groups else self._group_values("warmup_max_lr")

    @property
    def delta_lrs(self) -> list[float]:
        return [hi - lo for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]

    def get_lr(self) -> list[float]:
        """Return ``min + (max - min) * gamma`` for each param group (``min`` before the first step)."""
        if self.last_batch_iteration < 0:
            logger.warning(NOT_STARTED_WARNING)
            return list(self.min_lrs)
        gamma = self._get_gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs, strict=True)]

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_gamma(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0


class WarmupDecayLR(WarmupLR):
    """``WarmupLR``, then a linear decay to 0 at ``total_num_steps``.

    After warmup gamma = max(0, (total - it) / max(1, total - N)).

    Args:
        optimizer: a torch optimizer or a wrapper with ``.optimizer``.
        total_num_steps: the iteration at which the learning rate reaches 0.
        warmup_min_lr: the starting learning rate (scalar or one per param group).
        warmup_max_lr: the learning rate at the end of warmup; ``None`` means each group's current ``lr``.
        warmup_num_steps: warmup iterations.
        warmup_type: 'log' or 'linear'; anything else warns and uses 'log'.
        last_batch_iteration: the iteration of the last applied step; -1 writes ``warmup_min_lr`` now.

    Raises:
        TypeError: if ``optimizer`` is not a torch optimizer or a wrapper of one.
        ValueError: if ``warmup_num_steps`` is not a positive integer or a per-group list has the wrong length.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_lr: PerGroup = 0.0,
        warmup_max_lr: PerGroup | None = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning(f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}")

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_gamma(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        remaining = self.total_num_steps - self.last_batch_iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_BatchSchedule):
    """Scale each group's original lr by a ratio that warms up, then follows a cosine down to ``cos_min_ratio``.

    lr = original_lr * ratio. During warmup (it < N) ratio = min_ratio + (1 - min_ratio) * gamma (gamma as in
    ``WarmupLR``); after it progress = min(1, (it - N + 1) / max(1, total - N)) and
    ratio = max(0, cos_min + (1 - cos_min) * (1 + cos(pi * progress)) / 2). Before the first step lr is 0.

    Args:
        optimizer: a torch optimizer or a wrapper with ``.optimizer``; its current lrs are the original lrs.
        total_num_steps: the iteration at which the cosine reaches ``cos_min_ratio``.
        warmup_min_ratio: the ratio at the start of warmup.
        warmup_num_steps: warmup iterations.
        cos_min_ratio: the ratio at the end of the cosine.
        warmup_type: 'log' or 'linear'; anything else warns and uses 'log'.
        last_batch_iteration: the iteration of the last applied step; -1 writes lr 0 now.

    Raises:
        TypeError: if ``optimizer`` is not a torch optimizer or a wrapper of one.
        ValueError: if ``warmup_num_steps`` is not a positive integer.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = _check_warmup_num_steps(warmup_num_steps)
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = _check_warmup_type(warmup_type)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning(f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}")
        if last_batch_iteration == -1:
            self._apply()

    def get_lr_ratio(self) -> float:
        """Return the ratio of the original lr at ``last_batch_iteration`` (0 before the first step)."""
        if self.last_batch_iteration < 0:
            logger.warning(NOT_STARTED_WARNING)
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            gamma = _warmup_gamma(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * gamma
        progress = (self.last_batch_iteration - self.warmup_num_steps + 1) / max(
            1, self.total_num_steps - self.warmup_num_steps
        )
        progress = min(1.0, progress)
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        """Return ``original_lr * ratio`` for each param group."""
        ratio = self.get_lr_ratio()
        return [org_lr * ratio for org_lr in self.org_lrs]

    @property
    def org_lrs(self) -> list[float]:
        """Upstream's name for the groups' original lrs (``base_lrs``)."""
        return self.base_lrs
