"""The transaction's arithmetic: the clip factor equals upstream's formula in Python floats bit for bit,
and a step that needs no host decision (fp32, or bf16 with check_grad_overflow off) never waits for the device."""

import math

import pytest
import torch

import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.optimizer_step import NON_FINITE_NORM, norm_and_grad_factor
from unit.common import DistributedTest
from unit.runtime.engine_harness import make_config, make_model


def reference_factor(sum_of_squares: float, scale: float, clip: float) -> tuple:
    """Upstream's clipping in Python floats: divide by ((norm + 1e-6) / clip), floored at 1; clip <= 0 disables."""
    norm = math.sqrt(sum_of_squares) / scale
    coefficient = max(1.0, (norm + 1e-6) / clip) if clip > 0 else 1.0
    return norm, 1.0 / (scale * coefficient)


@pytest.mark.parametrize("sum_of_squares", [0.0, 1e-12, 0.3, 2.0, 7.5e3, 1e30])
@pytest.mark.parametrize("scale", [1.0, 1024.0, 65536.0])
@pytest.mark.parametrize("clip", [0.0, 1.0, 0.37])
def test_factor_equals_the_python_formula(sum_of_squares, scale, clip):
    stats = torch.tensor([sum_of_squares, 0.0], dtype=torch.float64)
    grad_norm, factor = norm_and_grad_factor(stats, scale, clip)
    expected_norm, expected_factor = reference_factor(sum_of_squares, scale, clip)
    # torch's and Python's sqrt may differ in the last bit of a double; the fp32 factor must not.
    assert grad_norm.item() == pytest.approx(expected_norm, rel=1e-15)
    assert factor.dtype == torch.float32
    assert factor.item() == torch.tensor(expected_factor, dtype=torch.float32).item()
    # What the step multiplies gradients by: the fp32 factor and the Python float give the same bits.
    grads = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 1e3
    assert torch.equal(grads * factor, grads * expected_factor)


def test_non_finite_gradients_report_minus_one_and_are_not_clipped():
    stats = torch.tensor([0.0, 1.0], dtype=torch.float64)
    grad_norm, factor = norm_and_grad_factor(stats, 4.0, clip=1.0)
    assert grad_norm.item() == NON_FINITE_NORM
    assert factor.item() == 0.25


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device synchronisation is only observable on CUDA")
class TestStepDoesNotWaitForTheDevice(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("stage", [1, 2])
    @pytest.mark.parametrize("optimizer", ["muon", "adamw"])
    def test_bf16_step_issues_no_synchronising_call(self, stage, optimizer):
        model = make_model(hidden_dim=32, nlayers=3)
        for param in model.parameters():
            param.use_muon = param.ndim == 2
        optimizer_config = {"type": "Muon", "params": {"lr": 0.02}} if optimizer == "muon" else None
        # bf16 skips non-finite steps by default, a decision the host must take; without it nothing waits.
        config = make_config(stage, "bf16", micro=4, optimizer=optimizer_config, clip=1.0,
                             bf16={"check_grad_overflow": False})
        engine, _, _, _ = deepspeed.initialize(model=model, config=config)
        device = get_accelerator().current_device_name()
        x = torch.randn(4, 32, device=device, dtype=torch.bfloat16)
        y = torch.randint(0, 32, (4, ), device=device)
        for step in range(3):
            loss = engine(x, y)
            engine.backward(loss)
            # The first step creates optimizer state; from then on the step must be all asynchronous.
            torch.cuda.set_sync_debug_mode("error" if step > 0 else "default")
            try:
                engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert math.isfinite(engine.get_global_grad_norm())
