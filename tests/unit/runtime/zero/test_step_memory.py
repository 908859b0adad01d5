"""What the ZeRO-2 optimizer step allocates beyond what it holds: bounded buffers, never an fp32 copy of the
gradients.

The reduced gradients arrive in the model dtype, loss-scaled; the step unscales them a chunk at a time into one
bounded buffer (runtime/unscaled_chunks.py), for Adam, AdamW and Muon's fold alike, and Newton-Schulz runs in the
lp weights, which are dead during the step. Measured on the CPU allocator's own records (torch.profiler), every
allocation and free in time order, over one whole engine.step() after the state exists.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import deepspeed
from deepspeed.accelerator import get_accelerator
import deepspeed.comm as dist
from deepspeed.runtime import unscaled_chunks
from unit.common import DistributedTest

VOCAB, WIDTH, SEQ = 8192, 64, 16
# A chunk far smaller than the gradients (a multiple of 64, as the real one is), so the bound below tells a chunk
# from the whole.
CHUNK = 4096


class EmbeddingHeavyNet(torch.nn.Module):
    """A tied token table (Adam) and two blocks of transformer-shaped matrices (Muon): Newton-Schulz on the
    matrices, in bf16, fits in the model's lp weights, so the step needs no memory of its own for it."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({
            "qkv": torch.nn.Linear(WIDTH, 3 * WIDTH, bias=False),
            "proj": torch.nn.Linear(WIDTH, WIDTH, bias=False),
            "fc": torch.nn.Linear(WIDTH, 4 * WIDTH, bias=False),
            "fc_proj": torch.nn.Linear(4 * WIDTH, WIDTH, bias=False),
        }) for _ in range(2))

    def forward(self, tokens, targets):
        h = self.embed(tokens)
        for block in self.blocks:
            q, k, v = block["qkv"](h).chunk(3, dim=-1)
            h = h + block["proj"](F.scaled_dot_product_attention(q, k, v, is_causal=True))
            h = h + block["fc_proj"](F.gelu(block["fc"](h)))
        return F.cross_entropy((h @ self.embed.weight.T).flatten(0, 1).float(), targets.flatten())


def config(optimizer):
    params = {"lr": 1e-3}
    if optimizer == "muon":
        params.update(ns_dtype="bf16")
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "bf16": {"enabled": True},
            "optimizer": {"type": optimizer, "params": params},
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 50_000}}


def step_allocation_peak(engine) -> int:
    """Bytes the step allocates above what was allocated when it began, at its highest."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        engine.step()
    held = peak = 0
    for event in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns()):
        if event.name() == "[memory]":
            held += event.nbytes()
            peak = max(peak, held)
    return peak


class TestStepTemporaries(DistributedTest):
    world_size = [1, 2]

    @pytest.mark.parametrize("optimizer", ["adamw", "muon"])
    def test_step_allocates_a_fraction_of_an_fp32_gradient_copy(self, optimizer):
        if get_accelerator().device_name() != "cpu":
            pytest.skip("reads the CPU allocator's events; on a GPU benchmarks/memory_breakdown.py measures the step")
        saved_chunk = unscaled_chunks.UNSCALE_CHUNK_NUMEL
        unscaled_chunks.UNSCALE_CHUNK_NUMEL = CHUNK
        try:
            torch.manual_seed(0)
            engine, _, _, _ = deepspeed.initialize(model=EmbeddingHeavyNet(), config=config(optimizer))
            rank = dist.get_rank()
            peaks = []
            for step in range(3):
                tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(step + rank))
                engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
                # The first step creates the optimizer state (kept, not temporary): measure the later ones.
                peaks.append(step_allocation_peak(engine) if step > 0 else engine.step())
        finally:
            unscaled_chunks.UNSCALE_CHUNK_NUMEL = saved_chunk
        zero = engine.optimizer
        fp32_gradient_bytes = 4 * sum(layout.partition_size for layout in zero.layouts)
        # gloo stages an all-gather's output in a buffer of its own, as large as the output (the whole flat group
        # the step publishes); NCCL gathers in place. That buffer is the collective's, not the step's.
        gather_staging = 0 if dist.get_world_size() == 1 else max(
            flat.numel() * flat.element_size() for flat in zero.bit16_groups_flat)
        assert engine.skipped_steps == 0
        for peak in peaks[1:]:
            # A whole fp32 copy of the gradients would add fp32_gradient_bytes, a copy of the lp partition half that.
            assert peak - gather_staging <= fp32_gradient_bytes / 8, (
                f"the {optimizer} step allocated {peak} bytes ({gather_staging} of them the all-gather's); an fp32 "
                f"copy of this rank's gradients is {fp32_gradient_bytes}")
