"""Symmetric products computed on the tiles on and above the diagonal, each stored with its mirror, with their
addends in the epilogue: ``ns_ops.OPS.whole_symmetric_product`` on a GPU.

Why: every m x m matrix of the symmetric Gram iteration ("gram_sym") is symmetric, and so is X X^T. Through cuBLAS
the iteration computes them on blocks on and above the diagonal (5/8 to 3/4 of the flops) and pays passes over
memory around the products: the quarters below the diagonal mirrored, a W + alpha Z summed before its product, a
added to P's diagonal. One Triton kernel with tensor-memory-access loads computes only the 128 x 128 tiles on and
above the diagonal (m = 2048: 136 of 256, 53 % of the flops), writes each tile and its transpose, and adds up to two
addends and a constant diagonal to the fp32 accumulator before its one rounding, so those passes are gone and the
matrices are stored whole (their readers take whole products, Q X in one GEMM).

Results: fp32 accumulation over K in order, alpha applied to the accumulator, then the addends, rounded once to the
output's dtype; each tile below the diagonal is the transpose of the one above it. Compared with cuBLAS's products
(tests/unit/ops/muon/kernels/test_symmetric_tiles.py on a GPU) they agree to the accumulation order.

Taken where it runs as such (Hopper or later, Triton with tensor descriptors, fp16/bf16, m at least MIN_SIZE and a
multiple of 256, each matrix's rows or columns contiguous and the batch dense); everywhere else ``ns_ops``'s torch
product runs, and the symmetric iteration keeps its matrices upper-stored (``whole_symmetric_supported`` says
False).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from deepspeed.runtime.zero.muon.kernels.fused_momentum import launched, switched_on, triton_available
from deepspeed.runtime.zero.muon.math import ns_ops

# Tile and pipeline: 128 x 128 output tiles, 64-deep slices of K, eight warps, three stages in shared memory, one
# program per tile (the shape the 1.11B training step was timed with; 128-deep slices, four stages, and persistent
# programs, one or two per SM, were slower on its products on an H200).
BM, BK, WARPS, STAGES = 128, 64, 8, 3
# The kernel is taken for m x m products from this size (where it was measured: the 1.11B GPT's m = 2048, where it
# beat the upper blocks on every product it replaces); smaller ones stay on cuBLAS's blocks.
MIN_SIZE = 2048
_FAILED: list[Exception] = []
# "0" keeps the symmetric iteration on cuBLAS's upper blocks (benchmarks compare the two); "1", the default, or unset:
# the kernel where it runs.
ENV_SWITCH = "DS_MUON_TRIANGULAR"


def whole_symmetric_supported(like: Tensor) -> bool:
    """Whether :func:`whole_symmetric_product` runs the kernel for m x m results like ``like`` (count, m, m)."""
    # The switch first, so that a value it refuses is refused on every machine.
    return (switched_on(ENV_SWITCH, "the triangular product where it runs", "cuBLAS's upper blocks")
            and like.is_cuda and like.ndim == 3
            and like.dtype in (torch.float16, torch.bfloat16) and like.size(-1) == like.size(-2)
            and like.size(-1) >= MIN_SIZE and like.size(-1) % (2 * BM) == 0 and not _FAILED
            and _tensor_descriptors(like.device.index))


def whole_symmetric_product(A: Tensor, B: Tensor, out: Tensor, alpha: float = 1.0, addend: Tensor | None = None,
                            beta: float = 0.0, addend2: Tensor | None = None, beta2: float = 0.0,
                            gamma: float = 0.0) -> Tensor:
    """:func:`~deepspeed.runtime.zero.muon.math.ns_ops.whole_symmetric_product` through the triangular kernel where
    it can take the operands, else torch's (X X^T of an X it cannot read: the upper blocks through cuBLAS, then the
    block below the diagonal as their transpose). Returns ``out``."""
    if _launch(A, B, out, alpha, addend, beta, addend2, beta2, gamma):
        return out
    if A is B and addend is None and addend2 is None and not gamma and alpha == 1.0:
        from deepspeed.runtime.zero.muon.math.symmetric_gram import completed, symmetric_gram

        symmetric_gram(A, out)
        return completed(out)
    return ns_ops.whole_symmetric_product(A, B, out, alpha, addend, beta, addend2, beta2, gamma)


def _layout(T: Tensor, m: int) -> str | None:
    """"rows" when each (m, K) matrix of the dense batch ``T`` is row-major, "cols" when column-major (the
    transpose of a dense (count, K, m) batch), else None."""
    count, rows, K = T.shape
    if rows != m:
        return None
    if T.stride() == (m * K, K, 1):
        return "rows"
    if T.stride() == (m * K, 1, m):
        return "cols"
    return None


def _dense_square(T: Tensor | None, like: Tensor) -> bool:
    return T is None or (T.shape == like.shape and T.dtype == like.dtype and T.device == like.device
                         and T.is_contiguous())


def _launch(A: Tensor, B: Tensor, out: Tensor, alpha: float, addend: Tensor | None, beta: float,
            addend2: Tensor | None, beta2: float, gamma: float) -> bool:
    if not whole_symmetric_supported(out) or not out.is_contiguous():
        return False
    count, m, _ = out.shape
    K = A.size(-1)
    layout = _layout(A, m)
    if (layout is None or _layout(B, m) != layout or A.shape != B.shape or A.size(0) != count or K % BK
            or A.dtype != out.dtype or B.dtype != out.dtype or A.device != out.device or B.device != out.device
            or not (_dense_square(addend, out) and _dense_square(addend2, out))
            or any(t is not None and t.data_ptr() % 16 for t in (A, B, out, addend, addend2))):
        return False
    from triton.tools.tensor_descriptor import TensorDescriptor

    from deepspeed.runtime.zero.muon.kernels.symmetric_tiles_kernel import symmetric_tiles_kernel

    def descriptor(T: Tensor, block: list[int]) -> TensorDescriptor:
        flat = T.mT.reshape(count * K, m) if layout == "cols" else T.reshape(count * m, K)
        return TensorDescriptor.from_tensor(flat, block)

    def square(T: Tensor) -> TensorDescriptor:
        return TensorDescriptor.from_tensor(T.view(count * m, m), [BM, BM])

    def launch() -> None:
        block = [BK, BM] if layout == "cols" else [BM, BK]
        a_desc, b_desc, c_desc = descriptor(A, block), descriptor(B, block), square(out)
        d_desc = square(addend) if addend is not None else c_desc
        e_desc = square(addend2) if addend2 is not None else c_desc
        tiles = (m // BM) * (m // BM + 1) // 2
        flags = dict(BM=BM, BK=BK, TRANSPOSED=layout == "cols", HAS_ADDEND=addend is not None,
                     HAS_ADDEND2=addend2 is not None, HAS_GAMMA=gamma != 0.0, num_warps=WARPS, num_stages=STAGES)
        symmetric_tiles_kernel[(tiles, count)](a_desc, b_desc, c_desc, d_desc, e_desc, m, K, alpha, beta, beta2, gamma,
                                               **flags)

    return launched(_FAILED, launch, out.device, "triangular product", "torch's products")


@functools.cache
def _tensor_descriptors(index: int | None) -> bool:
    """Triton runs here and offers host tensor descriptors, and the GPU has tensor memory access (NVIDIA, Hopper on;
    the kernel was not built for ROCm's)."""
    if not triton_available() or torch.version.hip or torch.cuda.get_device_capability(index)[0] < 9:
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True
