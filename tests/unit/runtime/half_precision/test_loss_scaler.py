"""Loss scaler state machines against sequences derived by hand from upstream's rules (spec §3.1, §3.2, §3.4).

Rules used for the expected values: on overflow, if ``delayed_shift == 1`` or ``cur_hysteresis == 1`` the scale
is halved (not below ``min_scale``; at ``min_scale`` it raises), else only ``cur_hysteresis`` drops by one. On a
good step with stable = cur_iter - last_overflow_iter - 1, the scale doubles when stable > 0 and
stable % window == 0, refilling the hysteresis (every good step refills it with ``consecutive_hysteresis``).
"""

import json
import logging
from collections.abc import Iterator, Sequence

import pytest
import torch

from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler, DynamicLossScaler, LossScaler
from unit.util import LogMessages

MIN_SCALE_ERROR = "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."


@pytest.fixture
def ds_log(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Messages sent to the "DeepSpeed" logger, captured by our own handler.

    A handler on the logger itself works whatever deepspeed.utils.logging does with propagation.
    """
    monkeypatch.delenv("RANK", raising=False)
    ds_logger = logging.getLogger("DeepSpeed")
    handler = LogMessages()
    old_level = ds_logger.level
    ds_logger.addHandler(handler)
    ds_logger.setLevel(logging.INFO)
    try:
        yield handler.messages
    finally:
        ds_logger.removeHandler(handler)
        ds_logger.setLevel(old_level)


def run(scaler: DynamicLossScaler, overflows: Sequence[bool]) -> list[tuple[float, int]]:
    """Feed ``overflows`` and return (cur_scale, cur_hysteresis) after each call."""
    trace = []
    for overflow in overflows:
        scaler.update_scale(overflow)
        trace.append((scaler.cur_scale, scaler.cur_hysteresis))
    return trace


def test_initial_state() -> None:
    scaler = DynamicLossScaler(init_scale=2**16, scale_window=1000, delayed_shift=2)
    assert scaler.dynamic is True
    assert scaler.cur_scale == scaler.loss_scale == 2**16
    assert (scaler.cur_iter, scaler.last_overflow_iter, scaler.scale_factor) == (0, -1, 2.0)
    assert (scaler.scale_window, scaler.min_scale, scaler.delayed_shift, scaler.cur_hysteresis) == (1000, 1, 2, 2)
    assert scaler.consecutive_hysteresis is False


def test_upstream_defaults() -> None:
    scaler = DynamicLossScaler()
    assert (scaler.cur_scale, scaler.scale_factor, scaler.scale_window, scaler.min_scale) == (2**32, 2.0, 1000, 1)
    assert (scaler.delayed_shift, scaler.consecutive_hysteresis, scaler.raise_error_at_min_scale) == (1, False, True)
    assert scaler.dtype == torch.half


def test_default_hysteresis_first_overflow_only_decrements() -> None:
    scaler = DynamicLossScaler(init_scale=2**16, delayed_shift=2)
    # 1st: hysteresis 2 -> 1, scale kept. Later: hysteresis stays 1, so every overflow halves.
    assert run(scaler, [True, True, True]) == [(2**16, 1), (2**15, 1), (2**14, 1)]
    assert (scaler.cur_iter, scaler.last_overflow_iter) == (3, 2)


def test_good_steps_below_window_do_not_refill_hysteresis() -> None:
    scaler = DynamicLossScaler(init_scale=1024, scale_window=1000, delayed_shift=2)
    assert run(scaler, [True, False, False, True]) == [(1024, 1), (1024, 1), (1024, 1), (512, 1)]


def test_window_doubling_from_fresh_start() -> None:
    scaler = DynamicLossScaler(init_scale=1024, scale_window=3)
    # stable == cur_iter from a fresh start: doubles at iterations 3, 6, 9 (the 4th call = window + 1, then every
    # window calls).
    scales = [scale for scale, _ in run(scaler, [False] * 10)]
    assert scales == [1024, 1024, 1024, 2048, 2048, 2048, 4096, 4096, 4096, 8192]


def test_first_doubling_after_overflow_is_at_j_plus_1_plus_window() -> None:
    scaler = DynamicLossScaler(init_scale=1024, scale_window=3)
    overflows = [False, False, True] + [False] * 7  # overflow at j = 2
    scales = [scale for scale, _ in run(scaler, overflows)]
    # Doublings at 2 + 1 + 3 = 6 and then 9. Iteration 3 (stable 0) must not double.
    assert scales == [1024, 1024, 512, 512, 512, 512, 1024, 1024, 1024, 2048]


def test_doubling_refills_hysteresis() -> None:
    scaler = DynamicLossScaler(init_scale=1024, scale_window=2, delayed_shift=2)
    # iter 0 overflow: h 2 -> 1; iters 1, 2: stable 0, 1; iter 3: stable 2 -> double and refill h to 2;
    # iter 4 overflow: h 2 -> 1; iter 5 overflow: halve.
    trace = run(scaler, [True, False, False, False, True, True])
    assert trace == [(1024, 1), (1024, 1), (1024, 1), (2048, 2), (2048, 1), (1024, 1)]


def test_consecutive_hysteresis_refills_on_every_good_step() -> None:
    scaler = DynamicLossScaler(init_scale=1024, scale_window=1000, delayed_shift=2, consecutive_hysteresis=True)
    trace = run(scaler, [True, False, True, True, False, True])
    assert trace == [(1024, 1), (1024, 2), (1024, 1), (512, 1), (512, 2), (512, 1)]


def test_consecutive_hysteresis_still_doubles_on_window() -> None:
    scaler = DynamicLossScaler(init_scale=8, scale_window=2, delayed_shift=3, consecutive_hysteresis=True)
    assert run(scaler, [False, False, False, True, False]) == [(8, 3), (8, 3), (16, 3), (16, 2), (16, 3)]


def test_scale_factor_is_used_both_ways() -> None:
    scaler = DynamicLossScaler(init_scale=81, scale_factor=3.0, scale_window=1)
    # window 1: doubles (x3) on every good step with stable > 0, i.e. not right after an overflow.
    scales = [scale for scale, _ in run(scaler, [True, False, False, True])]
    assert scales == [27, 27, 81, 27]


def test_min_scale_raises_exact_exception() -> None:
    scaler = DynamicLossScaler(init_scale=4, min_scale=1)
    assert [s for s, _ in run(scaler, [True, True])] == [2, 1]
    with pytest.raises(Exception) as excinfo:
        scaler.update_scale(True)
    assert type(excinfo.value) is Exception
    assert str(excinfo.value) == MIN_SCALE_ERROR
    # Upstream raises before recording the overflow.
    assert (scaler.cur_scale, scaler.cur_iter, scaler.last_overflow_iter) == (1, 2, 1)


def test_halving_is_clamped_to_min_scale() -> None:
    scaler = DynamicLossScaler(init_scale=3, min_scale=2)
    scaler.update_scale(True)
    assert scaler.cur_scale == 2  # max(3 / 2, 2)
    with pytest.raises(Exception, match="already at minimum"):
        scaler.update_scale(True)


def test_hysteresis_absorbs_overflow_at_min_scale() -> None:
    scaler = DynamicLossScaler(init_scale=1, min_scale=1, delayed_shift=2)
    scaler.update_scale(True)
    assert (scaler.cur_scale, scaler.cur_hysteresis) == (1, 1)
    with pytest.raises(Exception, match="already at minimum"):
        scaler.update_scale(True)


def test_no_raise_at_min_scale_when_disabled(ds_log: list[str]) -> None:
    scaler = DynamicLossScaler(init_scale=2, min_scale=1, raise_error_at_min_scale=False)
    assert [s for s, _ in run(scaler, [True, True, True])] == [1, 1, 1]
    assert ds_log[-1] == "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 1, reducing to 1"


def test_log_lines_exact(ds_log: list[str]) -> None:
    scaler = DynamicLossScaler(init_scale=2**16, delayed_shift=2)
    scaler.update_scale(True)
    scaler.update_scale(True)
    assert ds_log == [
        "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, but hysteresis is 2. "
        "Reducing hysteresis to 1",
        "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768",
    ]


def test_consecutive_hysteresis_log_on_every_good_step(ds_log: list[str]) -> None:
    scaler = DynamicLossScaler(init_scale=16, delayed_shift=3, consecutive_hysteresis=True)
    run(scaler, [False, False])
    assert ds_log == ["Consecutive hysteresis is enabled. Restoring hysteresis to 3"] * 2


def test_non_fp16_log_omits_scale(ds_log: list[str]) -> None:
    scaler = DynamicLossScaler(init_scale=16, delayed_shift=2, dtype=torch.bfloat16)
    run(scaler, [True, True])
    assert ds_log == ["[deepspeed] OVERFLOW! Rank 0 Skipping step."] * 2


def test_only_rank_0_logs(ds_log: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    scaler = DynamicLossScaler(init_scale=16, delayed_shift=2, consecutive_hysteresis=True)
    assert run(scaler, [True, True, False]) == [(16, 1), (8, 1), (8, 2)]
    assert ds_log == []


def test_static_scaler_never_changes() -> None:
    scaler = LossScaler(128)
    assert scaler.dynamic is False
    for overflow in [True, False, True, True] + [False] * 2000:
        scaler.update_scale(overflow)
    assert scaler.cur_scale == scaler.loss_scale == 128
    assert LossScaler().loss_scale == 1


def test_scale_loss_and_backward() -> None:
    scaler = DynamicLossScaler(init_scale=8)
    assert scaler.scale_loss(torch.tensor(1.5)).item() == 12.0
    weight = torch.tensor([2.0], requires_grad=True)
    LossScaler(4).backward((weight * 3).sum())
    assert weight.grad.tolist() == [12.0]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"init_scale": 0},
        {"min_scale": -1},
        {"scale_factor": 1.0},
        {"scale_window": 0},
        {"scale_window": 2.5},
        {"delayed_shift": 0},
        {"delayed_shift": True},
    ],
)
def test_dynamic_rejects_bad_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        DynamicLossScaler(**kwargs)


@pytest.mark.parametrize("scale", [0, -2.0, float("inf"), float("nan"), True])
def test_static_rejects_bad_scale(scale: float) -> None:
    with pytest.raises(ValueError, match="static loss scale"):
        LossScaler(scale)


def test_create_fp16_dynamic() -> None:
    args = {
        "init_scale": 2**16,
        "scale_window": 500,
        "delayed_shift": 2,
        "consecutive_hysteresis": True,
        "min_scale": 4,
    }
    scaler = CreateLossScaler(torch.half, 0, True, args)
    assert isinstance(scaler, DynamicLossScaler)
    assert (scaler.cur_scale, scaler.scale_window, scaler.delayed_shift, scaler.min_scale) == (2**16, 500, 2, 4)
    assert scaler.consecutive_hysteresis is True
    assert scaler.raise_error_at_min_scale is True
    assert scaler.dtype == torch.half


def test_create_fp16_static() -> None:
    scaler = CreateLossScaler(torch.half, 256.0, False, None)
    assert type(scaler) is LossScaler
    assert (scaler.loss_scale, scaler.dynamic) == (256.0, False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_create_non_fp16_is_static_one(dtype: torch.dtype) -> None:
    scaler = CreateLossScaler(dtype, 0, True, {"init_scale": 2**16})
    assert type(scaler) is LossScaler
    assert scaler.loss_scale == 1.0


def test_create_dynamic_without_args() -> None:
    with pytest.raises(AssertionError, match="^Dynamic loss scaling parameters must be defined.$"):
        CreateLossScaler(torch.half, 0, True, None)


def test_create_dynamic_unknown_arg() -> None:
    with pytest.raises(ValueError, match="hysteresis"):
        CreateLossScaler(torch.half, 0, True, {"init_scale": 2**16, "hysteresis": 2})


SCRIPT = [
    False,
    True,
    False,
    False,
    False,
    True,
    True,
    False,
    False,
    False,
    False,
    False,
    False,
    True,
    False,
    False,
    False,
    False,
    False,
    False,
    False,
    True,
    True,
    True,
    False,
    False,
    False,
    False,
    False,
    False,
]


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("cut", [0, 1, 6, 14, 22])
def test_state_dict_round_trip_equals_continuing(consecutive: bool, cut: int) -> None:
    uninterrupted = DynamicLossScaler(
        init_scale=2**10, scale_window=3, delayed_shift=2, consecutive_hysteresis=consecutive
    )
    run(uninterrupted, SCRIPT[:cut])
    # Through JSON: the state must be plain data, not objects.
    saved = json.loads(json.dumps(uninterrupted.state_dict()))
    assert saved["type"] == "dynamic"
    resumed = DynamicLossScaler()  # different configuration: the checkpoint's wins, as with upstream's pickle
    resumed.load_state_dict(saved)
    assert resumed.state_dict() == uninterrupted.state_dict()
    for overflow in SCRIPT[cut:]:
        uninterrupted.update_scale(overflow)
        resumed.update_scale(overflow)
        assert resumed.state_dict() == uninterrupted.state_dict()


def test_dynamic_state_dict_contents() -> None:
    scaler = DynamicLossScaler(init_scale=2**10, scale_window=3, delayed_shift=2)
    run(scaler, [True, False])
    assert scaler.state_dict() == {
        "type": "dynamic",
        "cur_scale": 2**10,
        "cur_iter": 2,
        "last_overflow_iter": 0,
        "scale_factor": 2.0,
        "scale_window": 3,
        "min_scale": 1,
        "delayed_shift": 2,
        "cur_hysteresis": 1,
        "consecutive_hysteresis": False,
        "raise_error_at_min_scale": True,
    }


def test_static_state_dict_round_trip() -> None:
    saved = json.loads(json.dumps(LossScaler(64).state_dict()))
    assert saved == {"type": "static", "cur_scale": 64}
    scaler = LossScaler(1)
    scaler.load_state_dict(saved)
    assert scaler.loss_scale == 64


def _dynamic_state() -> dict:
    scaler = DynamicLossScaler(init_scale=2**10)
    run(scaler, [True, False])
    return scaler.state_dict()


@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda d: d.pop("cur_hysteresis"), "cur_hysteresis"),
        (lambda d: d.update(growth_interval=5), "growth_interval"),
        (lambda d: d.update(cur_iter="2"), "cur_iter"),
        (lambda d: d.update(consecutive_hysteresis=1), "consecutive_hysteresis"),
        (lambda d: d.update(type="static"), "static"),
        (lambda d: d.pop("type"), "type"),
    ],
)
def test_dynamic_load_rejects_bad_dicts(edit, named: str) -> None:
    state = _dynamic_state()
    edit(state)
    scaler = DynamicLossScaler(init_scale=8)
    before = scaler.state_dict()
    with pytest.raises(ValueError, match=named):
        scaler.load_state_dict(state)
    assert scaler.state_dict() == before


def test_static_load_rejects_dynamic_state() -> None:
    with pytest.raises(ValueError, match="'dynamic'"):
        LossScaler(2).load_state_dict(_dynamic_state())
    with pytest.raises(ValueError, match="extra"):
        LossScaler(2).load_state_dict({"type": "static", "cur_scale": 4, "extra": 1})
