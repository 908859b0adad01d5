"""LR schedules against the closed-form formulas of spec §2.3, iteration by iteration."""

import math
from collections.abc import Callable, Iterator

import pytest
import torch

from deepspeed.runtime.lr_schedules import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    get_torch_optimizer,
)
from unit.util import captured_log

LOG_N = math.log


def make_optimizer(kind: str = "adam", lrs: list[float] = (0.1,)) -> torch.optim.Optimizer:
    """One param group per entry of ``lrs``."""
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lrs[0])
    return torch.optim.Adam(groups, lr=lrs[0])


def lrs_of(optimizer: torch.optim.Optimizer) -> list[float]:
    return [group["lr"] for group in optimizer.param_groups]


def step_to(scheduler, iteration: int) -> None:
    """Step one iteration at a time (the engine's way) until ``last_batch_iteration == iteration``."""
    while scheduler.last_batch_iteration < iteration:
        scheduler.step()


@pytest.fixture
def ds_log() -> Iterator[list[str]]:
    """Messages sent to the "DeepSpeed" logger (our handler, whatever the logger's propagation)."""
    with captured_log() as messages:
        yield messages


ITERATIONS = [0, 1, 4, 9, 10, 11, 19, 20, 25, 60]


def test_warmup_lr_log() -> None:
    optimizer = make_optimizer()
    lo, hi, n = 0.01, 0.1, 10
    scheduler = WarmupLR(optimizer, warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=n)
    assert lrs_of(optimizer) == [lo]  # written at construction (iteration -1)
    for it in ITERATIONS:
        step_to(scheduler, it)
        gamma = LOG_N(it + 1) / LOG_N(n) if it < n else 1.0
        assert lrs_of(optimizer) == pytest.approx([lo + (hi - lo) * gamma])
        assert scheduler.get_last_lr() == lrs_of(optimizer)
        assert scheduler.get_lr() == lrs_of(optimizer)


def test_warmup_lr_linear_and_max_from_groups() -> None:
    optimizer = make_optimizer(lrs=[0.1, 0.2])
    scheduler = WarmupLR(optimizer, warmup_min_lr=[0.0, 0.05], warmup_num_steps=8, warmup_type="linear")
    assert lrs_of(optimizer) == [0.0, 0.05]
    for it in ITERATIONS:
        step_to(scheduler, it)
        gamma = it / 8 if it < 8 else 1.0
        assert lrs_of(optimizer) == pytest.approx([0.1 * gamma, 0.05 + 0.15 * gamma])


def test_warmup_lr_construction_warns(ds_log: list[str]) -> None:
    WarmupLR(make_optimizer(), warmup_max_lr=0.1, warmup_num_steps=5)
    assert "Attempting to get learning rate from scheduler before it has started" in ds_log


def test_warmup_num_steps_minimum_is_two() -> None:
    optimizer = make_optimizer()
    scheduler = WarmupLR(optimizer, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=1)
    assert scheduler.warmup_num_steps == 2
    scheduler.step()
    assert lrs_of(optimizer) == [0.0]  # ln(1) / ln(2)
    scheduler.step()
    assert lrs_of(optimizer) == [1.0]


@pytest.mark.parametrize("bad", [0, -3, 2.5, "10", True, None])
@pytest.mark.parametrize(
    "build",
    [
        lambda opt, n: WarmupLR(opt, warmup_num_steps=n),
        lambda opt, n: WarmupDecayLR(opt, total_num_steps=100, warmup_num_steps=n),
        lambda opt, n: WarmupCosineLR(opt, total_num_steps=100, warmup_num_steps=n),
    ],
)
def test_warmup_num_steps_validation(build: Callable, bad) -> None:
    with pytest.raises(ValueError, match="warmup_num_steps must be a positive integer"):
        build(make_optimizer(), bad)


def test_unknown_warmup_type_falls_back_to_log(ds_log: list[str]) -> None:
    optimizer = make_optimizer()
    scheduler = WarmupLR(optimizer, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="cubic")
    assert scheduler.warmup_type == "log"
    assert any("unknown warmup_type: cubic" in message for message in ds_log)
    step_to(scheduler, 3)
    assert lrs_of(optimizer) == pytest.approx([LOG_N(4) / LOG_N(10)])


def test_per_group_list_length_checked() -> None:
    with pytest.raises(ValueError, match="warmup_min_lr"):
        WarmupLR(make_optimizer(lrs=[0.1, 0.2]), warmup_min_lr=[0.0, 0.0, 0.0])


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_decay_lr(warmup_type: str) -> None:
    optimizer = make_optimizer()
    lo, hi, n, total = 0.001, 0.01, 10, 25
    scheduler = WarmupDecayLR(
        optimizer,
        total_num_steps=total,
        warmup_min_lr=lo,
        warmup_max_lr=hi,
        warmup_num_steps=n,
        warmup_type=warmup_type,
    )
    assert lrs_of(optimizer) == [lo]
    for it in ITERATIONS:
        step_to(scheduler, it)
        if it < n:
            gamma = LOG_N(it + 1) / LOG_N(n) if warmup_type == "log" else it / n
        else:
            gamma = max(0.0, (total - it) / max(1, total - n))
        assert lrs_of(optimizer) == pytest.approx([lo + (hi - lo) * gamma])


def test_warmup_decay_lr_default_max_and_short_total(ds_log: list[str]) -> None:
    optimizer = make_optimizer()
    scheduler = WarmupDecayLR(optimizer, total_num_steps=5, warmup_num_steps=10)
    assert scheduler.max_lrs == [0.001]
    assert any("total_num_steps 5 is less than warmup_num_steps 10" in message for message in ds_log)
    step_to(scheduler, 10)  # after warmup, past total: max(0, negative) -> 0
    assert lrs_of(optimizer) == [0.0]


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_cosine_lr(warmup_type: str) -> None:
    optimizer = make_optimizer(lrs=[0.1, 0.3])
    n, total, min_ratio, cos_min = 10, 25, 0.1, 0.01
    scheduler = WarmupCosineLR(
        optimizer,
        total_num_steps=total,
        warmup_min_ratio=min_ratio,
        warmup_num_steps=n,
        cos_min_ratio=cos_min,
        warmup_type=warmup_type,
    )
    assert lrs_of(optimizer) == [0.0, 0.0]  # before the first step lr is 0
    for it in ITERATIONS:
        step_to(scheduler, it)
        if it < n:
            gamma = LOG_N(it + 1) / LOG_N(n) if warmup_type == "log" else it / n
            ratio = min_ratio + (1 - min_ratio) * gamma
        else:
            progress = min(1.0, (it - n + 1) / max(1, total - n))
            ratio = max(0.0, cos_min + (1 - cos_min) * (1 + math.cos(math.pi * progress)) / 2)
        assert lrs_of(optimizer) == pytest.approx([0.1 * ratio, 0.3 * ratio])
    assert lrs_of(optimizer) == pytest.approx([0.1 * cos_min, 0.3 * cos_min])  # progress clamped at 1


def test_warmup_cosine_defaults() -> None:
    scheduler = WarmupCosineLR(make_optimizer(), total_num_steps=5000)
    assert (scheduler.warmup_min_ratio, scheduler.warmup_num_steps, scheduler.cos_min_ratio) == (0.0, 1000, 0.0001)
    assert scheduler.warmup_type == "log"
    assert scheduler.org_lrs == [0.1]


def one_cycle_reference(it: int) -> dict[str, float]:
    """OneCycle(min 0.01, max 0.1, first 4, second 6, decay every 2 at lr rate 0.5, mom 0.85..0.95, rate 0.1)."""
    lo, hi, mom_lo, mom_hi = 0.01, 0.1, 0.85, 0.95
    b = it + 1
    if it < 10:
        s = b / 4 if b <= 4 else (10 - b) / 6  # rise over 4 iterations, fall over 6
        return {"lr": lo + (hi - lo) * s, "beta1": mom_hi - (mom_hi - mom_lo) * s}
    d = it - 10 + 1
    return {"lr": lo / (1 + 0.5 * d / 2), "beta1": mom_hi * (1 + 0.1 * d / 2)}


def test_one_cycle() -> None:
    optimizer = make_optimizer(lrs=[0.1, 0.1])
    optimizer.param_groups[1]["betas"] = (0.9, 0.98)
    scheduler = OneCycle(
        optimizer,
        cycle_min_lr=0.01,
        cycle_max_lr=0.1,
        decay_lr_rate=0.5,
        cycle_first_step_size=4,
        cycle_second_step_size=6,
        decay_step_size=2,
        cycle_min_mom=0.85,
        cycle_max_mom=0.95,
        decay_mom_rate=0.1,
    )
    assert lrs_of(optimizer) == pytest.approx([0.01, 0.01])
    for it in [0, 1, 3, 4, 6, 8, 9, 10, 11, 15, 30]:
        step_to(scheduler, it)
        expected = one_cycle_reference(it)
        assert lrs_of(optimizer) == pytest.approx([expected["lr"]] * 2)
        betas = [group["betas"] for group in optimizer.param_groups]
        assert [b[0] for b in betas] == pytest.approx([expected["beta1"]] * 2)
        assert [b[1] for b in betas] == [0.999, 0.98]  # beta2 kept per group


def test_one_cycle_without_decay_holds_min() -> None:
    optimizer = make_optimizer()
    scheduler = OneCycle(optimizer, cycle_min_lr=0.01, cycle_max_lr=0.1, decay_lr_rate=0.5, cycle_first_step_size=3)
    assert scheduler.total_size == 6  # second size defaults to the first
    step_to(scheduler, 2)
    assert lrs_of(optimizer) == pytest.approx([0.1])  # peak at iteration first_step_size - 1
    step_to(scheduler, 50)
    assert lrs_of(optimizer) == pytest.approx([0.01])
    assert optimizer.param_groups[0]["betas"][0] == pytest.approx(0.9)


def test_one_cycle_momentum_needs_betas(ds_log: list[str]) -> None:
    optimizer = make_optimizer("sgd")
    scheduler = OneCycle(optimizer, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=2)
    assert scheduler.cycle_momentum is False
    assert scheduler.get_mom() is None
    assert "betas" not in optimizer.param_groups[0]
    assert any("cycle_momentum is disabled" in message for message in ds_log)
    step_to(scheduler, 1)
    assert lrs_of(optimizer) == pytest.approx([0.1])


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"cycle_first_step_size": 0}, "cycle_first_step_size"),
        ({"cycle_first_step_size": -2}, "cycle_first_step_size"),
        ({"cycle_second_step_size": -1}, "cycle_second_step_size"),
    ],
)
def test_one_cycle_step_size_validation(kwargs: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        OneCycle(make_optimizer(), cycle_min_lr=0.01, cycle_max_lr=0.1, **kwargs)


def test_one_cycle_zero_second_step() -> None:
    optimizer = make_optimizer()
    scheduler = OneCycle(
        optimizer,
        cycle_min_lr=0.0,
        cycle_max_lr=1.0,
        cycle_first_step_size=4,
        cycle_second_step_size=0,
        cycle_momentum=False,
    )
    step_to(scheduler, 2)
    assert lrs_of(optimizer) == pytest.approx([0.75])


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test(staircase: bool) -> None:
    optimizer = make_optimizer(lrs=[0.1, 0.1])
    scheduler = LRRangeTest(
        optimizer,
        lr_range_test_min_lr=[0.01, 0.02],
        lr_range_test_step_size=4,
        lr_range_test_step_rate=2.0,
        lr_range_test_staircase=staircase,
    )
    assert lrs_of(optimizer) == [0.01, 0.02]
    for it in ITERATIONS:
        step_to(scheduler, it)
        interval = (it + 1) / 4
        if staircase:
            interval = math.floor(interval)
        assert lrs_of(optimizer) == pytest.approx([0.01 * (1 + 2 * interval), 0.02 * (1 + 2 * interval)])


def test_lr_range_test_defaults() -> None:
    scheduler = LRRangeTest(make_optimizer())
    assert (scheduler.min_lr, scheduler.step_size, scheduler.step_rate, scheduler.staircase) == (
        [1e-3],
        2000,
        1.0,
        False,
    )


SCHEDULES = {
    "WarmupLR": lambda opt: WarmupLR(opt, warmup_min_lr=0.01, warmup_num_steps=6),
    "WarmupDecayLR": lambda opt: WarmupDecayLR(opt, total_num_steps=12, warmup_num_steps=4, warmup_type="linear"),
    "WarmupCosineLR": lambda opt: WarmupCosineLR(opt, total_num_steps=12, warmup_num_steps=4),
    "OneCycle": lambda opt: OneCycle(
        opt,
        cycle_min_lr=0.01,
        cycle_max_lr=0.1,
        cycle_first_step_size=3,
        decay_step_size=1,
        decay_lr_rate=0.1,
        decay_mom_rate=0.01,
    ),
    "LRRangeTest": lambda opt: LRRangeTest(opt, lr_range_test_step_size=3, lr_range_test_staircase=True),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_state_dict_round_trip_equals_continuing(name: str) -> None:
    build = SCHEDULES[name]
    uninterrupted_opt = make_optimizer(lrs=[0.1, 0.2])
    uninterrupted = build(uninterrupted_opt)
    step_to(uninterrupted, 4)
    state = uninterrupted.state_dict()
    assert state == {"last_batch_iteration": 4, "base_lrs": [0.1, 0.2], "reference_lr": 0.1}

    # The resumed optimizer's groups hold other lrs when the schedule is built (as after loading a scheduled
    # optimizer's state): the saved split, not those, must drive the schedule.
    resumed_opt = make_optimizer(lrs=[0.1, 0.2])
    for group in resumed_opt.param_groups:
        group["lr"] = 0.05
    resumed = build(resumed_opt)
    resumed.load_state_dict(state)
    for _ in range(15):
        uninterrupted.step()
        resumed.step()
        assert lrs_of(resumed_opt) == lrs_of(uninterrupted_opt)
        assert resumed.get_last_lr() == uninterrupted.get_last_lr()
        assert [g.get("betas") for g in resumed_opt.param_groups] == [
            g.get("betas") for g in uninterrupted_opt.param_groups
        ]


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_upstream_state_dict_keeps_the_built_split(name: str) -> None:
    """Upstream's {'last_batch_iteration': n} loads and continues on the split the schedule was built with."""
    uninterrupted_opt, resumed_opt = make_optimizer(lrs=[0.1, 0.2]), make_optimizer(lrs=[0.1, 0.2])
    uninterrupted, resumed = SCHEDULES[name](uninterrupted_opt), SCHEDULES[name](resumed_opt)
    step_to(uninterrupted, 4)
    resumed.load_state_dict({"last_batch_iteration": 4})
    for _ in range(6):
        uninterrupted.step()
        resumed.step()
        assert lrs_of(resumed_opt) == lrs_of(uninterrupted_opt)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_load_state_dict_rejects_a_split_of_other_length(name: str) -> None:
    scheduler = SCHEDULES[name](make_optimizer(lrs=[0.1, 0.2]))
    with pytest.raises(ValueError, match="base_lrs has 3 values but the optimizer has 2 param groups"):
        scheduler.load_state_dict({"last_batch_iteration": 3, "base_lrs": [0.1, 0.2, 0.3], "reference_lr": 0.1})
    with pytest.raises(ValueError, match=r"missing keys \['reference_lr'\]"):
        scheduler.load_state_dict({"last_batch_iteration": 3, "base_lrs": [0.1, 0.2]})
    assert scheduler.last_batch_iteration == -1


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_load_state_dict_rejects_bad_keys(name: str) -> None:
    scheduler = SCHEDULES[name](make_optimizer())
    with pytest.raises(ValueError, match="last_batch_iteration"):
        scheduler.load_state_dict({})
    with pytest.raises(ValueError, match="epoch"):
        scheduler.load_state_dict({"last_batch_iteration": 3, "epoch": 1})
    assert scheduler.last_batch_iteration == -1


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_explicit_step_iteration(name: str) -> None:
    jumped_opt, walked_opt = make_optimizer(), make_optimizer()
    jumped, walked = SCHEDULES[name](jumped_opt), SCHEDULES[name](walked_opt)
    jumped.step(7)
    step_to(walked, 7)
    assert jumped.last_batch_iteration == 7
    assert lrs_of(jumped_opt) == lrs_of(walked_opt)


class _Wrapper:
    """Stands for the ZeRO optimizer: not a torch optimizer, but its param groups are the inner one's."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_wrapper_with_optimizer_attribute(name: str) -> None:
    inner, reference = make_optimizer(), make_optimizer()
    wrapped, plain = SCHEDULES[name](_Wrapper(inner)), SCHEDULES[name](reference)
    assert wrapped.optimizer is inner
    step_to(wrapped, 3)
    step_to(plain, 3)
    assert lrs_of(inner) == lrs_of(reference)


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("bad, type_name", [(object(), "object"), (_Wrapper(None), "_Wrapper")])
def test_bad_optimizer_type_error(name: str, bad, type_name: str) -> None:
    with pytest.raises(TypeError, match=f"^{type_name} is not a subclass of torch.optim.Optimizer$"):
        SCHEDULES[name](bad)


def test_get_torch_optimizer() -> None:
    optimizer = make_optimizer()
    assert get_torch_optimizer(optimizer) is optimizer
    assert get_torch_optimizer(_Wrapper(optimizer)) is optimizer


def test_get_last_lr_before_any_write() -> None:
    optimizer = make_optimizer()
    # A schedule resumed mid-run (last_batch_iteration != -1) writes nothing until its first step.
    scheduler = WarmupLR(optimizer, warmup_num_steps=10, last_batch_iteration=5)
    assert lrs_of(optimizer) == [0.1]
    with pytest.raises(AssertionError, match="need to call step"):
        scheduler.get_last_lr()
    scheduler.step()
    assert scheduler.last_batch_iteration == 6
    assert scheduler.get_last_lr() == lrs_of(optimizer)


# ------------------------------------------------------------------------------------------ the groups' lr split
# A Muon-like split: a group at 0.02 and one at 3e-4 (the reference, the optimizer's lr), as the Hugging Face
# Trainer's "auto" config gives it, with single schedule values of the reference's size.
MUON_LR, ADAM_LR = 0.02, 3e-4

SPLIT_SCHEDULES = {
    "WarmupLR": lambda opt: WarmupLR(opt, warmup_min_lr=1e-5, warmup_max_lr=ADAM_LR, warmup_num_steps=6),
    "WarmupDecayLR": lambda opt: WarmupDecayLR(opt, total_num_steps=20, warmup_min_lr=1e-5, warmup_max_lr=ADAM_LR,
                                               warmup_num_steps=6, warmup_type="linear"),
    "WarmupCosineLR": lambda opt: WarmupCosineLR(opt, total_num_steps=20, warmup_num_steps=6),
    "OneCycle": lambda opt: OneCycle(opt, cycle_min_lr=1e-5, cycle_max_lr=ADAM_LR, cycle_first_step_size=4,
                                     decay_step_size=2, decay_lr_rate=0.1),
    "LRRangeTest": lambda opt: LRRangeTest(opt, lr_range_test_min_lr=1e-5, lr_range_test_step_size=3),
}


def split_optimizer(reference: float | None = ADAM_LR) -> torch.optim.Optimizer:
    """Two groups at MUON_LR and ADAM_LR; ``defaults['lr']`` is ``reference``."""
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": MUON_LR},
              {"params": [torch.nn.Parameter(torch.zeros(2))], "lr": ADAM_LR}]
    optimizer = torch.optim.AdamW(groups, lr=ADAM_LR if reference is None else reference)
    if reference is None:
        del optimizer.defaults["lr"]
    return optimizer


@pytest.mark.parametrize("name", list(SPLIT_SCHEDULES))
def test_single_value_scales_each_group_from_its_own_lr(name: str) -> None:
    """Each group follows the one-group schedule of the reference lr, times its base lr / the reference."""
    build = SPLIT_SCHEDULES[name]
    split_opt, single_opt = split_optimizer(), make_optimizer(lrs=[ADAM_LR])
    split, single = build(split_opt), build(single_opt)
    assert lrs_of(split_opt) == pytest.approx([lrs_of(single_opt)[0] * MUON_LR / ADAM_LR, lrs_of(single_opt)[0]])
    peak = 0.0
    for _ in range(25):
        split.step()
        single.step()
        expected = lrs_of(single_opt)[0]
        assert lrs_of(split_opt) == pytest.approx([expected * MUON_LR / ADAM_LR, expected], rel=1e-12)
        peak = max(peak, lrs_of(split_opt)[0])
    # The Muon group reaches its own lr's scale, not the Adam group's (upstream wrote 3e-4 into both groups).
    assert peak > 10 * ADAM_LR


@pytest.mark.parametrize("name", ["WarmupLR", "WarmupDecayLR", "OneCycle", "LRRangeTest"])
def test_per_group_lists_are_written_as_given(name: str) -> None:
    """A list sets each group explicitly, whatever the groups' own lrs (WarmupCosineLR takes ratios, no lrs)."""
    optimizer = split_optimizer()
    if name == "WarmupLR":
        WarmupLR(optimizer, warmup_min_lr=[0.1, 0.2], warmup_max_lr=[0.3, 0.4], warmup_num_steps=4)
        assert lrs_of(optimizer) == [0.1, 0.2]
    elif name == "OneCycle":
        OneCycle(optimizer, cycle_min_lr=[0.1, 0.2], cycle_max_lr=[0.3, 0.4])
        assert lrs_of(optimizer) == [0.1, 0.2]
    elif name == "LRRangeTest":
        LRRangeTest(optimizer, lr_range_test_min_lr=[0.1, 0.2])
        assert lrs_of(optimizer) == [0.1, 0.2]
    else:
        scheduler = WarmupDecayLR(optimizer, total_num_steps=10, warmup_min_lr=[0.1, 0.2], warmup_max_lr=[0.3, 0.4],
                                  warmup_num_steps=2, warmup_type="linear")
        step_to(scheduler, 2)
        assert lrs_of(optimizer) == pytest.approx([0.3, 0.4])


def test_single_value_without_a_reference_is_refused() -> None:
    """Groups at different lrs and no reference lr: a non-zero single value cannot be placed, so it is refused."""
    with pytest.raises(ValueError, match=r"warmup_max_lr is a single value \(0.0003\) but the param groups have "
                       r"different learning rates \[0.02, 0.0003\]"):
        WarmupLR(split_optimizer(reference=None), warmup_max_lr=ADAM_LR)
    # A reference that is no group's lr (a constructor default, say) names none either.
    with pytest.raises(ValueError, match="cycle_max_lr is a single value"):
        OneCycle(split_optimizer(reference=1e-3), cycle_min_lr=0.0, cycle_max_lr=1e-3)
    # Zero needs no reference, and neither do groups that share one lr.
    scheduler = WarmupLR(split_optimizer(reference=None), warmup_min_lr=0.0, warmup_num_steps=2)
    step_to(scheduler, 3)
    assert lrs_of(scheduler.optimizer) == [MUON_LR, ADAM_LR]


def test_equal_groups_take_the_value_itself() -> None:
    """Groups sharing one lr each get the single value, whatever the constructor's lr (upstream's behaviour)."""
    optimizer = make_optimizer(lrs=[5e-4, 5e-4])
    optimizer.defaults["lr"] = 1e-3
    scheduler = WarmupLR(optimizer, warmup_min_lr=0.0, warmup_max_lr=2e-3, warmup_num_steps=2)
    step_to(scheduler, 3)
    assert lrs_of(optimizer) == [2e-3, 2e-3]
