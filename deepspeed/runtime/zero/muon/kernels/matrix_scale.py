"""Newton-Schulz's passes that scale every matrix of a batch by its own factor, in one vectorised pass.

Why: the iterations start by scaling each matrix to unit (or fixed) Frobenius norm and the symmetric Gram method
ends by undoing its fp16 scale; torch runs these as broadcast element-wise ops, which on a GPU take its generic
strided kernel, well below the memory bandwidth at the 1.11B point, for the normalisation and for the symmetric
method's two passes per call. Each matrix of such a batch is one dense block of memory (the
batch is contiguous, or the transpose of a contiguous one), so a flat kernel that looks the factor up per block
streams at full bandwidth. It computes what torch computes (fp32 arithmetic, IEEE division, torch's roundings),
so the bits are the same (checked on the GPU by tests/unit/ops/muon/kernels/test_matrix_scale.py).

Everywhere else (CPU, no Triton, other layouts) the torch ops run.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from deepspeed.runtime.zero.muon.kernels.fused_momentum import launched, triton_available

_BLOCK = 4096
_FAILED: list[Exception] = []


def scale_matrices(X: Tensor, factor: Tensor, out: Tensor, divide: bool = False) -> Tensor:
    """``out = X / factor`` (``divide``) or ``X * factor``, with ``factor`` of shape (count, 1, 1) for the 3-D
    batch ``X``, as torch's ``div``/``mul`` with ``out=`` compute it. ``out`` has X's shape and layout and may be
    X's own memory (in place, in the same or another 16-bit dtype). Returns ``out``."""
    if _fusable(X, out) and factor.is_contiguous() and factor.numel() == X.size(0) and _launch(
            X, out, factor, 0.0, matrix_numel=X[0].numel(), divide=divide, through_fp16=False):
        return out
    return (torch.div if divide else torch.mul)(X, factor, out=out)


def scale_fp16(X: Tensor, scalar: float, out: Tensor) -> Tensor:
    """``out = X * scalar`` for an fp16 ``X``, as ``torch.mul(X, scalar, out=out)`` computes it (rounded to fp16,
    then to out's dtype). ``out`` has X's shape and layout and may be X's own memory. Returns ``out``."""
    if X.dtype == torch.float16 and _fusable(X, out) and _launch(X, out, None, scalar, matrix_numel=1, divide=False,
                                                                 through_fp16=True):
        return out
    return torch.mul(X, scalar, out=out)


def _dense(tensor: Tensor) -> bool:
    return tensor.ndim == 3 and (tensor.is_contiguous() or tensor.mT.is_contiguous())


def _fusable(X: Tensor, out: Tensor) -> bool:
    return (X.is_cuda and not _FAILED and triton_available() and X.numel() > 0 and X.shape == out.shape
            and X.stride() == out.stride() and X.device == out.device and _dense(X)
            and X.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and out.dtype in (torch.float32, torch.bfloat16, torch.float16))


def _launch(X: Tensor, out: Tensor, factor: Tensor | None, scalar: float, matrix_numel: int, divide: bool,
            through_fp16: bool) -> bool:
    """Run the kernel; False (and torch from then on) when Triton cannot compile it here."""
    numel = X.numel()

    def launch() -> None:
        _kernel()[(-(-numel // _BLOCK), )](X, out, factor if factor is not None else X, scalar, numel, matrix_numel,
                                          PER_MATRIX=factor is not None, UNIFORM=matrix_numel % _BLOCK == 0,
                                          DIVIDE=divide, THROUGH_FP16=through_fp16, BLOCK=_BLOCK)

    return launched(_FAILED, launch, X.device, "per-matrix scaling", "torch's element-wise ops")


@functools.cache
def _kernel():
    from deepspeed.runtime.zero.muon.kernels.matrix_scale_kernel import scale_kernel

    return scale_kernel
