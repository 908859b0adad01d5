"""The shared test helpers in unit.simple_model and unit.util behave as upstream's do."""

import json

import pytest
import torch

from unit.simple_model import SimpleModel, args_from_dict, random_dataloader, random_dataset
from unit.util import bf16_required_version_check, torch_assert_close, torch_assert_equal


def test_single_layer_forward():
    torch.manual_seed(0)
    model = SimpleModel(4)
    x, y = torch.randn(3, 4), torch.tensor([0, 1, 3])
    expected = torch.nn.functional.cross_entropy(x @ model.linears[0].weight.T + model.linears[0].bias, y)
    torch_assert_close(model(x, y), expected)


def test_multi_layer_forward_reuses_early_layers():
    torch.manual_seed(0)
    model = SimpleModel(4, nlayers=3)
    x, y = torch.randn(2, 4), torch.tensor([2, 0])
    h = x
    for i, layer in enumerate(model.linears):
        h = model.linears[i // 2](h) + layer(h)
    torch_assert_equal(model(x, y), torch.nn.functional.cross_entropy(h, y))


def test_parameter_order_and_empty_grad():
    model = SimpleModel(4, empty_grad=True, nlayers=2)
    names = [name for name, _ in model.named_parameters()]
    assert names == [
        "linears.0.weight",
        "linears.0.bias",
        "linears.1.weight",
        "linears.1.bias",
        "linear2.weight",
        "linear2.bias",
    ]
    model(torch.randn(2, 4), torch.tensor([0, 1])).backward()
    assert model.linear2.weight.grad is None and model.linears[1].weight.grad is not None


def test_random_data_and_config_helpers(tmp_path):
    dataset = random_dataset(10, 6, "cpu", dtype=torch.float32)
    data, labels = dataset.tensors
    assert data.shape == (10, 6) and data.dtype == torch.float32
    assert labels.dtype == torch.long and 0 <= labels.min() and labels.max() < 6

    class Engine:
        def train_micro_batch_size_per_gpu(self):
            return 4

    batches = list(random_dataloader(Engine(), 10, 6, "cpu", dtype=torch.bfloat16))
    assert [len(b[0]) for b in batches] == [4, 4, 2] and batches[0][0].dtype == torch.bfloat16

    args = args_from_dict(tmp_path, {"train_batch_size": 2})
    assert args.deepspeed is True
    with open(args.deepspeed_config) as f:
        assert json.load(f) == {"train_batch_size": 2}


def test_assert_helpers_fail_when_they_should():
    torch_assert_equal(torch.ones(2), torch.ones(2))
    with pytest.raises(AssertionError):
        torch_assert_equal(torch.ones(2), torch.ones(2) + 1e-7)
    torch_assert_close(torch.ones(2), torch.ones(2) + 1e-7)
    with pytest.raises(AssertionError):
        torch_assert_close(torch.ones(2), torch.ones(2, dtype=torch.float64))


def test_bf16_check_is_a_bool():
    assert isinstance(bf16_required_version_check(), bool)
    assert bf16_required_version_check(accelerator_check=False) is True or torch.cuda.is_available()
