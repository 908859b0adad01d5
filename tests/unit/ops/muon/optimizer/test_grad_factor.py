"""MuonWithAuxAdam.step(grad_factor=f) on loss-scaled low-precision gradients gives the bits of step() on the fp32
gradients multiplied by f (the reference: a whole unscaled fp32 copy of them, made before the step), with the
gradients read a chunk at a time: the Adam step, the Muon fold into the workspace, and the whole-gradient path of a
group that cannot use a workspace."""

import pytest
import torch

from deepspeed.runtime import unscaled_chunks
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

pytestmark = pytest.mark.skipif(not hasattr(torch.Tensor, "grad_dtype"),
                                reason="a bf16 gradient for an fp32 param needs torch's grad_dtype")

# The optimizer's order (by size(), largest first), as ZeRO lays out a rank's masters; then a flat Adam partition.
MUON_SHAPES = [(48, 16)] * 2 + [(24, 24)] + [(16, 40)] * 3
ADAM_NUMEL = 700


def build(lend: bool):
    numels = [torch.Size(shape).numel() for shape in MUON_SHAPES] + [ADAM_NUMEL]
    master = torch.randn(sum(numels), generator=torch.Generator().manual_seed(0))
    pieces = master.split(numels)
    muon = [torch.nn.Parameter(piece.view(shape)) for piece, shape in zip(pieces, MUON_SHAPES)]
    adam = torch.nn.Parameter(pieces[-1])
    optimizer = MuonWithAuxAdam([
        {"params": muon, "use_muon": True, "lr": 0.05, "momentum": 0.9, "weight_decay": 0.1},
        {"params": [adam], "use_muon": False, "lr": 0.01, "weight_decay": 0.1},
    ])
    if lend:
        optimizer.lend_step_workspace([torch.zeros(200_000)])
    return optimizer, muon + [adam], numels


def state_tensors(optimizer, params):
    return [tensor for p in params for tensor in optimizer.state[p].values() if torch.is_tensor(tensor)]


@pytest.mark.parametrize("lend", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scaled_gradients_with_a_factor_give_the_bits_of_unscaled_fp32_gradients(dtype, lend, monkeypatch):
    # Chunks that do not line up with the matrices, so every consumer sees several; a multiple of 64 elements, as
    # the real size is, so a CPU kernel's vectorised blocks and tail cover the same elements as over the whole.
    monkeypatch.setattr(unscaled_chunks, "UNSCALE_CHUNK_NUMEL", 320)
    scaled_opt, scaled_params, numels = build(lend)
    plain_opt, plain_params, _ = build(lend)
    for step in range(3):
        generator = torch.Generator().manual_seed(10 + step)
        scaled = (torch.randn(sum(numels), generator=generator) * 1024).to(dtype)
        factor = torch.tensor(0.7 / 1024, dtype=torch.float32)
        unscaled = scaled.to(torch.float32, copy=True).mul_(factor)  # the reference: a whole unscaled fp32 copy
        for p, q, grad, grad32 in zip(scaled_params, plain_params, scaled.split(numels), unscaled.split(numels)):
            p.grad_dtype = None
            p.grad, q.grad = grad.view(p.shape), grad32.view(q.shape)
        scaled_opt.step(grad_factor=factor)
        plain_opt.step()
        for p, q in zip(scaled_params, plain_params):
            assert torch.equal(p, q), f"step {step}"
        for a, b in zip(state_tensors(scaled_opt, scaled_params), state_tensors(plain_opt, plain_params)):
            assert a.dtype == b.dtype and torch.equal(a, b), f"step {step}"
        # The caller's gradients are left as they were (the whole-gradient path puts them back).
        assert all(p.grad.dtype == dtype for p in scaled_params)
