"""Muon's fused kernels, each with its torch fallback in the same module: the momentum fold and direction, the update's
application, per-matrix scaling, the GEMM that reads its addend where it lies, the tiled block transpose, the
sum of blocks, the matrices' norms from partial sums and the triangular symmetric product.

Importing this package installs the Newton-Schulz ones into the math (``math.ns_ops.install``); the executor imports
the others directly.
"""

from deepspeed.runtime.zero.muon.kernels.block_add import add_scaled
from deepspeed.runtime.zero.muon.kernels.block_transpose import copy_transposed
from deepspeed.runtime.zero.muon.kernels.addend_gemm import gemm_with_addend, separate_addend_supported
from deepspeed.runtime.zero.muon.kernels.matrix_norm import matrix_norms
from deepspeed.runtime.zero.muon.kernels.matrix_scale import scale_fp16, scale_matrices
from deepspeed.runtime.zero.muon.kernels.symmetric_tiles import whole_symmetric_product, whole_symmetric_supported
from deepspeed.runtime.zero.muon.math.ns_ops import install

install(scale_matrices=scale_matrices, scale_fp16=scale_fp16, separate_addend_supported=separate_addend_supported,
        gemm_with_addend=gemm_with_addend, copy_transposed=copy_transposed, add_scaled=add_scaled,
        matrix_norms=matrix_norms, whole_symmetric_supported=whole_symmetric_supported,
        whole_symmetric_product=whole_symmetric_product)
