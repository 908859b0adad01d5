"""``out = beta * addend + alpha * A @ B`` for batches of matrices, with the addend read where it lies.

Why: ``torch.baddbmm(addend, A, B, out=out)`` with an addend other than ``out`` first copies the addend into
``out`` (torch's GEMM reads its C from the memory it writes D to). In the symmetric Gram iteration at the 1.11B
point those copies were 26 device-to-device memcpys a call, about a tenth of its time. cuBLASLt's
``cublasLtMatmul`` takes C and D as separate matrices, so the addend is read by the GEMM's epilogue and no copy is
made. This module calls it through ctypes on the cuBLASLt library torch already loaded: nothing is compiled.

:func:`gemm_with_addend` uses cuBLASLt where it can (a CUDA tensor in fp16 or bf16, each matrix with one unit
stride, cuBLASLt found and offering an algorithm for the shapes) and otherwise copies the addend and calls
``baddbmm``, the bits torch gives. Both accumulate in fp32 with the addend added in the accumulator (cuBLASLt is
offered no split-K reduction in the 16-bit output type); cuBLASLt may choose another kernel than torch's
``baddbmm``, so the two agree to fp32 accumulation order, not bit for bit.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from deepspeed.runtime.zero.muon.kernels.fused_momentum import switched_on

logger = logging.getLogger(__name__)

# Set to "0" to always take the copy-then-baddbmm path (benchmarks compare the two).
ENV_SWITCH = "DS_MUON_SEPARATE_ADDEND"

# cuBLASLt enums (cublasLt.h, cublas_api.h, library_types.h).
_CUDA_R_32F, _CUDA_R_16F, _CUDA_R_16BF = 0, 2, 14
_CUBLAS_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_LAYOUT_BATCH_COUNT, _LAYOUT_STRIDED_BATCH_OFFSET = 5, 6
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_REDUCTION_SCHEME_MASK = 3
_REDUCTION_SCHEME_COMPUTE_TYPE = 2  # split-K partial sums in the compute type (fp32); no scheme is always allowed
_PREF_MIN_ALIGNMENT = (5, 6, 7, 8)  # A, B, C, D, in bytes
_DTYPES = {torch.float16: _CUDA_R_16F, torch.bfloat16: _CUDA_R_16BF}

# The most workspace the heuristic may plan for: cuBLAS's own size on Hopper. What the chosen algorithm needs is taken
# from torch's caching allocator for the call and given back at once, so it is reused by whatever comes next.
WORKSPACE_BYTES = 32 << 20


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _loaded_cublaslt_path() -> str | None:
    """The cuBLASLt library this process has loaded (torch's CUDA build links it), from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if "libcublasLt.so" in os.path.basename(path):
                    return path
    except OSError:
        return None
    return None


class _CublasLt:
    """The few cuBLASLt entry points used here, with their C signatures."""

    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        vp, i32, u64, i64, size = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
        pvp = ctypes.POINTER(ctypes.c_void_p)
        signatures = {
            "cublasLtCreate": [pvp],
            "cublasLtMatmulDescCreate": [pvp, i32, i32],
            "cublasLtMatmulDescSetAttribute": [vp, i32, vp, size],
            "cublasLtMatrixLayoutCreate": [pvp, i32, u64, u64, i64],
            "cublasLtMatrixLayoutSetAttribute": [vp, i32, vp, size],
            "cublasLtMatmulPreferenceCreate": [pvp],
            "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, size],
            "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i32, ctypes.POINTER(_HeuristicResult),
                                               ctypes.POINTER(i32)],
            "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.POINTER(_Algo), vp, size, vp],
        }
        for name, argtypes in signatures.items():
            function = getattr(lib, name)
            function.argtypes, function.restype = argtypes, ctypes.c_int
            setattr(self, name, function)
        self._handles: dict[int, ctypes.c_void_p] = {}

    def handle(self, device: int) -> ctypes.c_void_p:
        """This device's handle, created with the device current (one per device, as cuBLAS advises)."""
        if device not in self._handles:
            handle = ctypes.c_void_p()
            with torch.cuda.device(device):
                self.check(self.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
            self._handles[device] = handle
        return self._handles[device]

    @staticmethod
    def check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed with cuBLAS status {status}")

    def set_attribute(self, setter, obj, attribute: int, value) -> None:
        self.check(setter(obj, attribute, ctypes.byref(value), ctypes.sizeof(value)), setter.__name__)


def _switched_on() -> bool:
    return switched_on(ENV_SWITCH, "products read their addend in place", "the addend is copied into the output first")


@functools.cache
def _library() -> _CublasLt | None:
    if not _switched_on() or not torch.cuda.is_available():
        return None
    path = _loaded_cublaslt_path()
    if path is None:
        logger.warning("cuBLASLt is not loaded in this process: Newton-Schulz copies each GEMM addend into its "
                       "output first (a device-to-device copy per product with an addend)")
        return None
    return _CublasLt(path)


@dataclass(frozen=True)
class _Operand:
    """A torch (rows x cols) matrix batch as cuBLAS sees it: column-major, as stored, and whether to transpose."""

    op: int
    rows: int
    cols: int
    ld: int
    batch_stride: int


def _transposed_operand(T: Tensor) -> _Operand | None:
    """T^T in column-major terms (cuBLAS computes D^T = B^T A^T for row-major torch tensors), or None if T has no
    unit stride in its last two dimensions."""
    r, c = T.shape[-2:]
    sr, sc = T.stride()[-2:]
    batch_stride = T.stride(0)
    if sc == 1 and sr >= max(1, c):
        return _Operand(_OP_N, c, r, sr, batch_stride)   # memory is T^T column-major
    if sr == 1 and sc >= max(1, r):
        return _Operand(_OP_T, r, c, sc, batch_stride)   # memory is T column-major
    return None


def _alignment(tensor: Tensor) -> int:
    address = tensor.data_ptr()
    return min(256, address & -address) if address else 256


@dataclass
class _Plan:
    desc: ctypes.c_void_p
    layouts: tuple  # A, B, C, D layouts (cuBLAS's A is torch's B)
    algo: _Algo
    workspace_bytes: int


def _layout(lt: _CublasLt, dtype: int, operand: _Operand, batch: int) -> ctypes.c_void_p:
    layout = ctypes.c_void_p()
    lt.check(lt.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, operand.rows, operand.cols, operand.ld),
             "cublasLtMatrixLayoutCreate")
    lt.set_attribute(lt.cublasLtMatrixLayoutSetAttribute, layout, _LAYOUT_BATCH_COUNT, ctypes.c_int32(batch))
    lt.set_attribute(lt.cublasLtMatrixLayoutSetAttribute, layout, _LAYOUT_STRIDED_BATCH_OFFSET,
                     ctypes.c_int64(operand.batch_stride if batch > 1 else 0))
    return layout


# Plans by shape, strides, dtype and pointer alignments; None where cuBLASLt offered no algorithm. Descriptors
# are never destroyed: a run meets a handful of shapes.
_plans: dict[tuple, _Plan | None] = {}


def _plan(lt: _CublasLt, device: int, key: tuple, dtype: int, operands: tuple[_Operand, ...], batch: int,
          alignments: tuple[int, ...]) -> _Plan | None:
    if key in _plans:
        return _plans[key]
    a, b, c, d = operands
    desc = ctypes.c_void_p()
    lt.check(lt.cublasLtMatmulDescCreate(ctypes.byref(desc), _CUBLAS_COMPUTE_32F, _CUDA_R_32F),
             "cublasLtMatmulDescCreate")
    lt.set_attribute(lt.cublasLtMatmulDescSetAttribute, desc, _DESC_TRANSA, ctypes.c_int32(a.op))
    lt.set_attribute(lt.cublasLtMatmulDescSetAttribute, desc, _DESC_TRANSB, ctypes.c_int32(b.op))
    layouts = tuple(_layout(lt, dtype, operand, batch) for operand in operands)
    preference = ctypes.c_void_p()
    lt.check(lt.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)), "cublasLtMatmulPreferenceCreate")
    lt.set_attribute(lt.cublasLtMatmulPreferenceSetAttribute, preference, _PREF_MAX_WORKSPACE_BYTES,
                     ctypes.c_uint64(WORKSPACE_BYTES))
    lt.set_attribute(lt.cublasLtMatmulPreferenceSetAttribute, preference, _PREF_REDUCTION_SCHEME_MASK,
                     ctypes.c_uint32(_REDUCTION_SCHEME_COMPUTE_TYPE))
    for attribute, alignment in zip(_PREF_MIN_ALIGNMENT, alignments):
        lt.set_attribute(lt.cublasLtMatmulPreferenceSetAttribute, preference, attribute, ctypes.c_uint32(alignment))
    result, found = _HeuristicResult(), ctypes.c_int(0)
    status = lt.cublasLtMatmulAlgoGetHeuristic(lt.handle(device), desc, *layouts, preference, 1,
                                               ctypes.byref(result), ctypes.byref(found))
    found_one = status == 0 and found.value > 0 and result.state == 0
    plan = _Plan(desc, layouts, result.algo, result.workspace_size) if found_one else None
    if plan is None:
        logger.warning("cuBLASLt has no algorithm for a Newton-Schulz product (status %d, %d found; shapes %s): "
                       "its addend is copied into the output first", status, found.value, key[1:4])
    _plans[key] = plan
    return plan


def _separate_addend_plan(out: Tensor, addend: Tensor, A: Tensor, B: Tensor) -> tuple[_CublasLt, _Plan] | None:
    if not out.is_cuda or out.dtype not in _DTYPES or out.ndim != 3:
        return None
    if any(t.dtype != out.dtype or t.device != out.device or t.ndim != 3 for t in (addend, A, B)):
        return None
    if addend.shape != out.shape or out.stride(-1) != 1 or addend.stride(-1) != 1:
        return None
    # Shapes that do not fit go to baddbmm, which names the mismatch (cuBLASLt would read out of bounds).
    count, rows, cols = out.shape
    if A.shape != (count, rows, A.size(2)) or B.shape != (count, A.size(2), cols) or min(out.shape) == 0:
        return None
    lt = _library()
    if lt is None:
        return None
    batch = out.size(0)
    # cuBLAS's A is torch's B (D^T = B^T A^T); C and D are the addend and the output, transposed alike.
    operands = (_transposed_operand(B), _transposed_operand(A), _transposed_operand(addend), _transposed_operand(out))
    if any(operand is None for operand in operands):
        return None
    alignments = tuple(_alignment(t) for t in (B, A, addend, out))
    key = (_DTYPES[out.dtype], tuple(A.shape), tuple(B.shape), operands, batch, alignments, out.device.index)
    with torch.cuda.device(out.device):
        plan = _plan(lt, out.device.index, key, _DTYPES[out.dtype], operands, batch, alignments)
    return None if plan is None else (lt, plan)


def separate_addend_supported(out: Tensor) -> bool:
    """Whether products into ``out`` can read their addend where it lies (a CUDA fp16/bf16 tensor, cuBLASLt
    loaded). A product whose shapes cuBLASLt then turns down still copies, in :func:`gemm_with_addend`."""
    return out.is_cuda and out.dtype in _DTYPES and _library() is not None


def gemm_with_addend(out: Tensor, addend: Tensor, A: Tensor, B: Tensor, beta: float, alpha: float = 1.0) -> Tensor:
    """``out = beta * addend + alpha * A @ B`` for (count, m, k) A, (count, k, n) B and (count, m, n) addend and
    out, ``addend`` other memory than ``out`` (they must not overlap). Returns ``out``."""
    found = _separate_addend_plan(out, addend, A, B)
    if found is None:
        out.copy_(addend)
        return torch.baddbmm(out, A, B, beta=beta, alpha=alpha, out=out)
    lt, plan = found
    workspace = torch.empty(plan.workspace_bytes, dtype=torch.uint8, device=out.device)
    stream = torch.cuda.current_stream(out.device).cuda_stream
    with torch.cuda.device(out.device):
        lt.check(lt.cublasLtMatmul(lt.handle(out.device.index), plan.desc, ctypes.byref(ctypes.c_float(alpha)),
                                   B.data_ptr(), plan.layouts[0], A.data_ptr(), plan.layouts[1],
                                   ctypes.byref(ctypes.c_float(beta)), addend.data_ptr(), plan.layouts[2],
                                   out.data_ptr(), plan.layouts[3], ctypes.byref(plan.algo),
                                   workspace.data_ptr() if plan.workspace_bytes else None, plan.workspace_bytes,
                                   stream), "cublasLtMatmul")
    return out
