"""ZeRO-3 parameter offload (`zero_optimization.offload_param`): where the lp partitions live changes no number.

On CPU ranks the accelerator is the host, so what is observable is the residency itself: the partitions are host
tensors of their own, the forward and backward read fetched copies (never the partition, one rank included), and
those copies are released after use. The numbers must be those of the same run with the partitions on the
accelerator, bit for bit: placement is not arithmetic. The oracles (single-process torch parity, the skipped step,
resume, zero_to_fp32, the 16-bit export, resume at another world size) run with offload_param in test_stage3.py,
test_zero_init.py and unit/checkpoint/test_resume_other_world_size.py.
"""

import pytest
import torch

import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.param_residency import ZeroParamStatus
from unit.common import DistributedTest
from unit.runtime.engine_harness import fp32_masters, global_batches, make_config, make_model, train_steps
from unit.ops.muon.zero.test_muon_zero import HIDDEN, TinyNet, muon_config

HOST = {"device": "cpu", "pin_memory": True}


def _config(optimizer, dtype, offload_param, offload_optimizer):
    config = muon_config(3, dtype, micro=8) if optimizer == "muon" else make_config(3, dtype, micro=4)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if offload_param:
        zero["offload_param"] = dict(HOST)
    if offload_optimizer:
        zero["offload_optimizer"] = dict(HOST)
    config["zero_optimization"] = zero
    return config


def _build(optimizer, config):
    torch.manual_seed(0)
    model = TinyNet() if optimizer == "muon" else make_model(HIDDEN, nlayers=3)
    return deepspeed.initialize(model=model, config=config)[0]


def _partition_spans(engine):
    spans = []
    for partition in engine.optimizer.fp16_partitioned_groups_flat:
        start = partition.untyped_storage().data_ptr()
        spans.append((start, start + partition.untyped_storage().nbytes()))
    return spans


class TestParamOffloadIsPlacementOnly(DistributedTest):
    world_size = [1, 2]

    @pytest.mark.parametrize("offload_optimizer", [False, True])
    @pytest.mark.parametrize("optimizer,dtype", [("adamw", "fp16"), ("adamw", "bf16"), ("muon", "fp16"),
                                                 ("muon", "bf16")])
    def test_same_bits_as_partitions_on_the_accelerator(self, optimizer, dtype, offload_optimizer):
        import deepspeed.comm as dist
        batches = global_batches(4, 8 * dist.get_world_size(), HIDDEN)
        runs = []
        for offload_param in (False, True):
            engine = _build(optimizer, _config(optimizer, dtype, offload_param, offload_optimizer))
            assert engine.optimizer.placement.is_offloaded == offload_param
            assert engine.optimizer.cpu_offload == offload_optimizer
            # fp16: one overflow, skipped on both placements.
            poison = {1: float("inf")} if dtype == "fp16" else None
            losses = train_steps(engine, batches, dtype, loss_multipliers=poison)
            runs.append((losses, fp32_masters(engine),
                         [t.clone() for t in engine.optimizer.fp16_partitioned_groups_flat], engine.skipped_steps))
        (losses, masters, lp, skipped), (offloaded_losses, offloaded_masters, offloaded_lp, offloaded_skipped) = runs
        assert offloaded_losses == losses and offloaded_skipped == skipped
        assert skipped == (1 if dtype == "fp16" else 0)
        for got, want in zip(offloaded_masters + offloaded_lp, masters + lp, strict=True):
            assert got.dtype == want.dtype and torch.equal(got.cpu(), want.cpu())


class TestParamOffloadResidency(DistributedTest):
    world_size = [1, 2]

    @pytest.mark.parametrize("offload_param", [False, True])
    def test_partitions_are_host_tensors_fetched_and_released(self, offload_param):
        engine = _build("adamw", _config("adamw", "bf16", offload_param, offload_optimizer=offload_param))
        partitions = engine.optimizer.fp16_partitioned_groups_flat
        spans = _partition_spans(engine)
        accelerator_is_host = get_accelerator().device_name() == "cpu"
        if offload_param:
            assert all(p.device.type == "cpu" for p in partitions)
            assert all(p.is_pinned() for p in partitions) == (not accelerator_is_host)
        # Record, for each layer's forward, whether a parameter it reads lies in an lp partition's storage.
        reads_partition = []

        def record(module, _inputs):
            for param in module.parameters(recurse=False):
                assert param.ds_status == ZeroParamStatus.AVAILABLE and param.numel() == param.ds_numel
                pointer = param.untyped_storage().data_ptr()
                reads_partition.append(any(lo <= pointer < hi for lo, hi in spans))
                assert param.device == engine.device

        handles = [layer.register_forward_pre_hook(record) for layer in engine.module.linears]
        try:
            train_steps(engine, global_batches(2, 4 * engine.dp_world_size, HIDDEN), "bf16")
        finally:
            for handle in handles:
                handle.remove()
        assert reads_partition
        # One rank without offload computes on views of the partition; offloaded (and gathered at 2 ranks), on
        # fetched copies.
        in_place = engine.dp_world_size == 1 and not offload_param
        assert all(reads_partition) if in_place else not any(reads_partition), reads_partition
        # Between steps nothing fetched is kept: every partitioned parameter is a placeholder again.
        for param in engine.module.parameters():
            assert param.ds_status == ZeroParamStatus.NOT_AVAILABLE and param.numel() == 0
        assert engine.optimizer.residency._live_numel == 0


class CheckpointedStack(torch.nn.Module):
    """Linear blocks run through torch.utils.checkpoint (or not): the backward recomputes each block's forward,
    gathering its parameters again."""

    def __init__(self, checkpointed: bool, hidden=HIDDEN, blocks=3):
        super().__init__()
        self.checkpointed = checkpointed
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(hidden, 2 * hidden), torch.nn.GELU(),
                                                              torch.nn.Linear(2 * hidden, hidden))
                                          for _ in range(blocks))

    def forward(self, x, y):
        for block in self.blocks:
            x = x + (torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.checkpointed else
                     block(x))
        return torch.nn.functional.cross_entropy(x.float(), y)


class TestParamOffloadActivationCheckpointing(DistributedTest):
    world_size = [1, 2]

    def test_recomputed_forward_gathers_again_and_matches(self):
        import deepspeed.comm as dist
        config = _config("adamw", "bf16", offload_param=True, offload_optimizer=False)
        batches = global_batches(3, 4 * dist.get_world_size(), HIDDEN)
        runs = []
        for checkpointed in (False, True):
            torch.manual_seed(0)
            engine = deepspeed.initialize(model=CheckpointedStack(checkpointed), config=config)[0]
            losses = train_steps(engine, batches, "bf16")
            runs.append((losses, fp32_masters(engine)))
            for param in engine.module.parameters():
                assert param.ds_status == ZeroParamStatus.NOT_AVAILABLE and param.numel() == 0
            assert engine.optimizer.residency._live_numel == 0
        (losses, masters), (checkpointed_losses, checkpointed_masters) = runs
        assert checkpointed_losses == losses
        for got, want in zip(checkpointed_masters, masters, strict=True):
            assert torch.equal(got, want)


class TestParamOffloadGatheredPersistentParameters(DistributedTest):
    """`GatheredParameters(params, modifier_rank=0)` on parameters stage 3 keeps whole (persistent: below
    `stage3_param_persistence_threshold`, which the Hugging Face "auto" value sets to 10 x hidden, so every bias and
    norm) publishes rank 0's change as it does for partitioned ones: every rank's value and the fp32 masters. The
    oracle is the same change written with `safe_set_full_fp32_param`, then the same steps."""
    world_size = 2

    @pytest.mark.parametrize("offload_optimizer", [False, True])
    def test_modifier_rank_change_reaches_every_rank_and_the_masters(self, offload_optimizer):
        import deepspeed.comm as dist
        from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param
        config = _config("muon", "bf16", offload_param=True, offload_optimizer=offload_optimizer)
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 64  # the biases, not the matrices
        batches = global_batches(3, 8 * dist.get_world_size(), HIDDEN)
        runs = {}
        for how in ("gathered", "set_full"):
            engine = _build("muon", config)
            train_steps(engine, batches[:1], "bf16")
            targets = [engine.module.fc_mid.bias, engine.module.fc_mid.weight]
            assert targets[0].ds_persist and not targets[1].ds_persist
            new_values = [torch.linspace(-1, 1, p.ds_numel).view(p.ds_shape) for p in targets]
            if how == "gathered":
                with deepspeed.zero.GatheredParameters(targets, modifier_rank=0):
                    if dist.get_rank() == 0:
                        for param, value in zip(targets, new_values):
                            param.data.copy_(value.to(param.dtype))
            else:
                for param, value in zip(targets, new_values):
                    safe_set_full_fp32_param(param, value.to(torch.bfloat16).float())
            for param, value in zip(targets, new_values):
                assert torch.equal(safe_get_full_fp32_param(param), value.to(torch.bfloat16).float())
            # Every rank holds rank 0's value of the persistent bias.
            bias = targets[0].detach().float().cpu()
            everyone = [torch.zeros_like(bias) for _ in range(dist.get_world_size())]
            dist.all_gather(everyone, bias.to(engine.device))
            assert all(torch.equal(other.cpu(), everyone[0].cpu()) for other in everyone)
            train_steps(engine, batches[1:], "bf16")
            runs[how] = (fp32_masters(engine), [t.clone() for t in engine.optimizer.fp16_partitioned_groups_flat],
                         [p.detach().clone() for p in engine.module.parameters() if p.ds_persist])
        for got, want in zip(runs["gathered"], runs["set_full"], strict=True):
            assert len(got) == len(want)
            for a, b in zip(got, want):
                assert torch.equal(a, b)
