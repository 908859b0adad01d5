"""The block transpose gives torch's copy bit for bit: the Triton kernel on a GPU (blocks of a larger batch at an
offset, odd sizes across tile edges, every 16- and 32-bit float), torch's ``copy_`` elsewhere; the rest of the
buffer is left as it was."""

import pytest
import torch

from deepspeed.runtime.zero.muon.kernels.block_transpose import _fusable, copy_transposed
from deepspeed.runtime.zero.muon.kernels.fused_momentum import triton_available

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,rows,cols", [(8, 3, 5), (130, 64, 65), (300, 150, 75)])
def test_a_block_written_transposed_into_another_equals_torch_copy(device, dtype, m, rows, cols):
    generator = torch.Generator().manual_seed(m)
    S = torch.randn(3, m, m, generator=generator).to(device=device, dtype=dtype)
    source = S[:, :rows, m - cols:]  # above the diagonal, as the quarter mirror's sources lie
    target = S[:, m - cols:, :rows]
    expected = S.clone()
    expected[:, m - cols:, :rows] = expected[:, :rows, m - cols:].mT
    assert copy_transposed(target, source) is target
    assert torch.equal(S, expected)


@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="the kernel needs CUDA and Triton")
def test_the_kernel_is_what_runs_on_a_gpu():
    S = torch.zeros(2, 1024, 1024, device="cuda", dtype=torch.float16)
    assert _fusable(S[:, 256:512, :256], S[:, :256, 256:512])
