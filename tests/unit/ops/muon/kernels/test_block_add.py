"""The sums of matrix blocks in the symmetric Gram iteration give torch's bits: the Triton kernel on a GPU (the
blocks an upper-stored matrix holds, into new memory and into either operand's), torch's ``add`` elsewhere."""

import pytest
import torch

from deepspeed.runtime.zero.muon.kernels.block_add import _fusable, add_scaled
from deepspeed.runtime.zero.muon.kernels.fused_momentum import triton_available

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def matrices(count, m, dtype, device, seed):
    values = torch.randn(count, m, m, generator=torch.Generator().manual_seed(seed))
    values[0, 0, :3] = torch.tensor([6e-8, 6e4, -3e-5])  # near fp16's subnormals and its largest value
    return values.to(device=device, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [96, 5000])
@pytest.mark.parametrize("into", ["new", "first", "second"])
def test_blocks_add_as_torch(device, dtype, m, into):
    h = m // 2
    S, T = matrices(3, m, dtype, device, 0), matrices(3, m, dtype, device, 1)
    alpha = 0.3716
    expected = torch.add(S[:, :h], T[:, :h], alpha=alpha), torch.add(S[:, h:, h:], T[:, h:, h:], alpha=alpha)
    out = {"new": torch.full_like(S, float("nan")), "first": S, "second": T}[into]
    for block, want in zip(((slice(None), slice(0, h)), (slice(None), slice(h, None), slice(h, None))), expected):
        assert add_scaled(S[block], T[block], alpha, out[block]) is not None
        assert torch.equal(out[block], want)
    if device == "cuda" and triton_available():
        assert _fusable(S[:, :h], T[:, :h], out[:, :h])
