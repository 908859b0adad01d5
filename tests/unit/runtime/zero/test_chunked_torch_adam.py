"""torch's Adam and AdamW stepped a chunk at a time from loss-scaled low-precision gradients (what ZeRO does with
them) give the bits of torch's own step on the unscaled fp32 gradients, in each of torch's implementations."""

import pytest
import torch

from deepspeed.runtime import unscaled_chunks
from deepspeed.runtime.zero.chunked_torch_adam import chunked_step, steps_in_chunks

pytestmark = pytest.mark.skipif(not hasattr(torch.Tensor, "grad_dtype"),
                                reason="a bf16 gradient for an fp32 param needs torch's grad_dtype")

NUMELS = [1000, 333]  # two groups (ZeRO: one flat partition each), neither a multiple of the chunk


def build(cls, implementation, amsgrad):
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(numel, generator=generator) for numel in NUMELS]
    options = {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": amsgrad, **implementation}
    optimizer = cls([{"params": [params[0]]}, {"params": [params[1]], "lr": 3e-3}], **options)
    return optimizer, params


@pytest.mark.parametrize("amsgrad", [False, True])
# The single-tensor loop is the CPU default; it maximises here, for once.
@pytest.mark.parametrize("implementation", [{"fused": True}, {"foreach": True}, {"maximize": True}],
                         ids=["fused", "foreach", "single-tensor"])
@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_chunked_step_gives_the_bits_of_torchs_step(cls, implementation, amsgrad, monkeypatch):
    monkeypatch.setattr(unscaled_chunks, "UNSCALE_CHUNK_NUMEL", 128)  # a multiple of 64, as the real size is
    chunked, chunked_params = build(cls, implementation, amsgrad)
    plain, plain_params = build(cls, implementation, amsgrad)
    assert steps_in_chunks(chunked)
    for step in range(3):
        generator = torch.Generator().manual_seed(10 + step)
        factor = torch.tensor(0.3 / 512, dtype=torch.float32)
        for p, q, numel in zip(chunked_params, plain_params, NUMELS):
            scaled = (torch.randn(numel, generator=generator) * 512).bfloat16()
            p.grad_dtype = None
            p.grad, q.grad = scaled, scaled.to(torch.float32).mul_(factor)
        chunked_step(chunked, factor)
        plain.step()
        for p, q in zip(chunked_params, plain_params):
            assert torch.equal(p, q), f"step {step}"
            mine, theirs = chunked.state[p], plain.state[q]
            assert mine.keys() == theirs.keys()
            for key in mine:
                assert mine[key].dtype == theirs[key].dtype and torch.equal(mine[key], theirs[key]), (step, key)
        assert [g["params"] for g in chunked.param_groups] == [[p] for p in chunked_params]
        assert len(chunked.state) == len(chunked_params), "a chunk's state was left behind"


def test_only_torchs_own_adam_is_stepped_in_chunks():
    param = torch.zeros(4)

    class Subclass(torch.optim.AdamW):
        pass

    assert steps_in_chunks(torch.optim.AdamW([param]))
    assert not steps_in_chunks(Subclass([param]))
    assert not steps_in_chunks(torch.optim.SGD([param], lr=0.1))
