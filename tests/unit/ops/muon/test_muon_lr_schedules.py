"""LR schedules keep the param groups' lr split: Muon's matrices train at Muon's lr, Adam's at Adam's.

The Hugging Face Trainer writes a DeepSpeed scheduler with one peak lr (its "auto" value, the AdamW-sized
learning rate) beside a Muon optimizer whose `muon_lr` is far larger. Upstream wrote that single value into
every param group, so after warmup the Muon matrices trained at the Adam lr, silently. Here a single value is
the schedule of the reference lr (`optimizer.params.lr`) and each group follows it in proportion to its own lr.
Each case trains under ZeRO against a single-process reference that applies, step by step, the lrs the schedule
gives a one-group optimizer, times each group's ratio to the reference; the engine's `get_lr()` is checked at
every step too.
"""

import pytest
import torch

import deepspeed
from unit.common import DistributedTest

from muon_suite import (fp32_masters, global_batches, initialize, make_model, muon_config, reference_training,
                        relative_error, train)

STEPS, GLOBAL_BATCH = 6, 64
# The reference lr (optimizer.params.lr, also the Adam group's) and the Muon group's, 5x larger.
ADAM_LR, MUON_LR = 0.01, 0.05
TOLERANCE = 1e-3  # relative error of each parameter's change, as test_muon_reference_parity

# DeepSpeed's schedules with single values in units of the reference lr, each at a ZeRO stage of its own.
DS_SCHEDULES = {
    "WarmupLR": (1, {"warmup_min_lr": 0.002, "warmup_max_lr": ADAM_LR, "warmup_num_steps": 3,
                     "warmup_type": "linear"}),
    "WarmupDecayLR": (2, {"total_num_steps": STEPS, "warmup_min_lr": 0.002, "warmup_max_lr": ADAM_LR,
                          "warmup_num_steps": 2, "warmup_type": "linear"}),
    "WarmupCosineLR": (3, {"total_num_steps": STEPS, "warmup_num_steps": 2, "warmup_min_ratio": 0.2,
                           "warmup_type": "linear"}),
    "OneCycle": (2, {"cycle_min_lr": 0.002, "cycle_max_lr": ADAM_LR, "cycle_first_step_size": 2,
                     "cycle_momentum": False}),
    "LRRangeTest": (1, {"lr_range_test_min_lr": 0.002, "lr_range_test_step_size": 2}),
    # torch's schedulers are multiplicative: named in the config, they keep the split by themselves.
    "StepLR": (3, {"step_size": 2, "gamma": 0.5}),
}


def reference_lrs(build) -> list:
    """The lr each of STEPS steps runs at, for a one-group optimizer at the reference lr under `build`'s schedule."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=ADAM_LR)
    scheduler = build(optimizer)
    lrs = [optimizer.param_groups[0]["lr"]]
    for _ in range(STEPS - 1):
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


def schedule_builder(name, params):
    from deepspeed.runtime import lr_schedules
    cls = getattr(lr_schedules, name, None) or getattr(torch.optim.lr_scheduler, name)
    return lambda optimizer: cls(optimizer, **params)


def halving(step):
    return 0.5**step


def train_and_check(engine, model, batches, lrs):
    """Train `engine` and compare each step's group lrs and the final parameters with the reference."""
    expected_lrs = [(lr * MUON_LR / ADAM_LR, lr) for lr in lrs]
    expected = reference_training(model, batches, lr=MUON_LR, adam_lr=ADAM_LR, step_lrs=expected_lrs)
    start = fp32_masters(engine)
    for step, batch in enumerate(batches):
        assert engine.get_lr() == pytest.approx(list(expected_lrs[step]), rel=1e-12), f"lrs at step {step}"
        train(engine, [batch], "fp32")
    assert engine.skipped_steps == 0
    got = fp32_masters(engine)
    errors = {name: relative_error(got[name] - start[name], expected[name] - start[name]) for name in start}
    assert max(errors.values()) <= TOLERANCE, f"relative error vs the reference: {errors}"


def muon_schedule_config(stage, scheduler=None):
    # optimizer.params.lr is the reference (and the Adam group's lr); muon_lr sets the Muon group apart.
    config = muon_config(stage, "fp32", micro=GLOBAL_BATCH // 2, lr=ADAM_LR, adam_lr=ADAM_LR, muon_lr=MUON_LR,
                         clip=0.0, ns_method="standard")
    if scheduler is not None:
        config["scheduler"] = scheduler
    return config


class TestMuonLRSchedules(DistributedTest):
    reuse_dist_env = True
    world_size = 2

    @pytest.mark.parametrize("name", list(DS_SCHEDULES))
    def test_single_value_schedule_keeps_the_muon_lr(self, name):
        stage, params = DS_SCHEDULES[name]
        lrs = reference_lrs(schedule_builder(name, params))
        model = make_model()
        engine = initialize(model, muon_schedule_config(stage, {"type": name, "params": params}))
        train_and_check(engine, model, global_batches(STEPS, GLOBAL_BATCH), lrs)

    def test_client_torch_scheduler_keeps_the_muon_lr(self):
        lrs = reference_lrs(lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, halving))
        model = make_model()
        engine, _, _, _ = deepspeed.initialize(
            model=model, config=muon_schedule_config(0),
            lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, halving))
        train_and_check(engine, model, global_batches(STEPS, GLOBAL_BATCH), lrs)


class TestAdamWLRSchedules(DistributedTest):
    """The same rule for a client AdamW whose matrices and vectors are in groups at different lrs."""
    reuse_dist_env = True
    world_size = 2

    @pytest.mark.parametrize("name", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"])
    def test_single_value_schedule_keeps_each_group_lr(self, name):
        stage, params = DS_SCHEDULES[name]
        lrs = reference_lrs(schedule_builder(name, params))
        batches = global_batches(STEPS, GLOBAL_BATCH)
        model = make_model()

        def groups(module):
            matrices = [p for p in module.parameters() if p.ndim >= 2]
            vectors = [p for p in module.parameters() if p.ndim < 2]
            return [{"params": matrices, "lr": MUON_LR}, {"params": vectors, "lr": ADAM_LR}]

        reference = model.__class__()
        reference.load_state_dict(model.state_dict())
        reference_optimizer = torch.optim.AdamW(groups(reference), lr=ADAM_LR)
        for lr, (x, y) in zip(lrs, batches):
            reference_optimizer.param_groups[0]["lr"] = lr * MUON_LR / ADAM_LR
            reference_optimizer.param_groups[1]["lr"] = lr
            reference_optimizer.zero_grad()
            reference(x, y).backward()
            reference_optimizer.step()

        config = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // 2, "gradient_clipping": 0.0,
                  "steps_per_print": 10**6, "zero_optimization": {"stage": stage},
                  "scheduler": {"type": name, "params": params}}
        engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                               optimizer=torch.optim.AdamW(groups(model), lr=ADAM_LR))
        start = fp32_masters(engine)
        for step, batch in enumerate(batches):
            assert engine.get_lr() == pytest.approx([lrs[step] * MUON_LR / ADAM_LR, lrs[step]], rel=1e-12)
            train(engine, [batch], "fp32")
        got = fp32_masters(engine)
        expected = dict(reference.named_parameters())
        errors = {name: relative_error(got[name] - start[name], expected[name].detach() - start[name])
                  for name in start}
        assert max(errors.values()) <= 1e-5, f"relative error vs torch AdamW: {errors}"
