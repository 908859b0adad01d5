"""Prototype Newton-Schulz kernels that launch fewer kernels, timed beside the engine's to size a fix.

The engine's iterations (`original_muon`) spell every scalar-matrix combination as separate kernels
(`b * R + c * (R @ R)` is four launches), so on GPT-2-sized matrices the optimizer step is bound by kernel
launches, not arithmetic. These versions fold the scalars into `addmm` / `baddbmm` (one launch each) and
accept a batch of same-shape matrices, so a rank can orthogonalise all its matrices of one shape in one
pass. They compute the same function as `zeropower_via_newtonschulz5` / `zeropower_via_gram_newtonschulz`
(checked against them in `max_relative_error`). Nothing in deepspeed/ uses them.
"""

import torch

from deepspeed.runtime.zero.muon.original_muon import (GRAM_RESTART_ITERATIONS, NS_COEFFICIENTS, NS_NORM_EPS,
                                                       resolve_ns_dtype)


def _addmm(bias: torch.Tensor, left: torch.Tensor, right: torch.Tensor, beta: float, alpha: float = 1.0):
    """beta * bias + alpha * left @ right in one launch, for matrices or batches of matrices."""
    if left.ndim == 2:
        return torch.addmm(bias, left, right, beta=beta, alpha=alpha)
    return torch.baddbmm(bias, left, right, beta=beta, alpha=alpha)


def _normalized_wide(G: torch.Tensor, dtype):
    X = G.to(resolve_ns_dtype(G, dtype))
    is_transposed = X.size(-2) > X.size(-1)
    if is_transposed:
        X = X.mT
    return X / (X.norm(dim=(-2, -1), keepdim=True) + NS_NORM_EPS), is_transposed


def standard_ns_fused(G: torch.Tensor, steps: int = 5, dtype=None) -> torch.Tensor:
    """The quintic iteration with three launches per step (as torch.optim.Muon), batched over leading dims."""
    X, is_transposed = _normalized_wide(G, dtype)
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        A = X @ X.mT
        B = _addmm(A, A, A, beta=b, alpha=c)
        X = _addmm(X, B, X, beta=a)
    return X.mT if is_transposed else X


def gram_ns_fused(G: torch.Tensor, steps: int = 5, dtype=None) -> torch.Tensor:
    """The Gram iteration of `zeropower_via_gram_newtonschulz` with one launch per product, batched."""
    X, is_transposed = _normalized_wide(G, dtype)
    rows, cols = X.shape[-2:]
    if rows == cols:
        return standard_ns_fused(G, steps, dtype)
    a, b, c = NS_COEFFICIENTS
    eye = torch.eye(rows, dtype=X.dtype, device=X.device)
    R = X @ X.mT
    Q = None
    for k in range(steps):
        if k in GRAM_RESTART_ITERATIONS and Q is not None:
            X = Q @ X
            R = X @ X.mT
            Q = None
        Z = _addmm(R, R, R, beta=b, alpha=c)
        Q = torch.add(Z, eye, alpha=a) if Q is None else _addmm(Q, Z, Q, beta=a)
        if not (k + 1 == steps or k + 1 in GRAM_RESTART_ITERATIONS):
            PR = _addmm(R, Z, R, beta=a)
            R = _addmm(PR, Z, PR, beta=a)
    if Q is not None:
        X = Q @ X
    return X.mT if is_transposed else X


PROTOTYPES = {"standard": standard_ns_fused, "gram": gram_ns_fused}


def max_relative_error(reference_fns: dict, matrices: list, steps: int, dtype) -> float:
    """Largest ||prototype - engine|| / ||engine|| over `matrices` and both methods (float32 inputs)."""
    worst = 0.0
    for name, prototype in PROTOTYPES.items():
        for matrix in matrices:
            expected = reference_fns[name](matrix, steps=steps, dtype=dtype).float()
            got = prototype(matrix, steps=steps, dtype=dtype).float()
            worst = max(worst, ((got - expected).norm() / expected.norm()).item())
    return worst
