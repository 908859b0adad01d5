"""ZeRO stage 3's prefetch: after the first forward recorded the order, the units that follow are all-gathered ahead
of use within `stage3_prefetch_bucket_size`, and never past `stage3_max_live_parameters` gathered elements."""

import pytest
import torch

import deepspeed
from deepspeed.runtime.zero.param_residency import ZeroParamStatus
from unit.common import DistributedTest

WIDTH, LAYERS = 32, 6
UNIT_NUMEL = WIDTH * WIDTH + WIDTH  # one Linear's weight and bias


class Stack(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


def gathered_ahead(max_live=None):
    """Train one step (which records the order), then in the next forward count, as each layer starts, the later
    layers that are gathered or being gathered, and the gathered elements alive."""
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 10 * UNIT_NUMEL}
    if max_live is not None:
        zero["stage3_max_live_parameters"] = max_live
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": zero}
    engine, _, _, _ = deepspeed.initialize(model=Stack(), config=config)
    x = torch.randn(2, WIDTH, device=engine.device)
    engine.backward(engine(x))
    engine.step()
    layers = list(engine.module.layers)
    ahead, live = [], []

    def observe(module, _inputs):
        index = layers.index(module)
        states = [[p.ds_status for p in layer.parameters()] for layer in layers]
        ahead.append(sum(all(s != ZeroParamStatus.NOT_AVAILABLE for s in layer) for layer in states[index + 1:]))
        live.append(sum(p.ds_numel for layer in layers for p in layer.parameters()
                        if p.ds_status != ZeroParamStatus.NOT_AVAILABLE))

    handles = [layer.register_forward_pre_hook(observe) for layer in layers]
    engine.backward(engine(x))
    for handle in handles:
        handle.remove()
    engine.step()
    return ahead, live


class TestStage3Prefetch(DistributedTest):
    world_size = 2

    def test_following_units_are_gathered_ahead(self):
        ahead, _ = gathered_ahead()
        assert ahead[0] == LAYERS - 1, ahead  # the whole rest of the order fits in the bucket

    @pytest.mark.parametrize("units", [1, 3])
    def test_max_live_parameters_bounds_the_prefetch(self, units):
        limit = units * UNIT_NUMEL  # parameter elements, as upstream counts them
        ahead, live = gathered_ahead(max_live=limit)
        assert max(ahead) == units - 1, ahead
        assert max(live) <= limit, live
