"""Small models, random data and config helpers shared by engine tests (upstream's names and shapes)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator

from .common import preferred_dtype


class SimpleModel(torch.nn.Module):
    """`nlayers` Linear(h, h) layers ending in cross-entropy; with several layers early ones are reused.

    Parameter order: linears.0.weight, linears.0.bias, linears.1.weight, ... then linear2.* if empty_grad.
    """

    def __init__(self, hidden_dim: int, empty_grad: bool = False, nlayers: int = 1) -> None:
        """Build the layers; `empty_grad` adds `linear2`, which forward never uses (its grads stay None)."""
        super().__init__()
        self.linears = torch.nn.ModuleList([torch.nn.Linear(hidden_dim, hidden_dim) for _ in range(nlayers)])
        if empty_grad:
            self.linear2 = torch.nn.Linear(hidden_dim, hidden_dim)
        self.cross_entropy_loss = torch.nn.CrossEntropyLoss()
        self.empty_grad = empty_grad

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Return the scalar cross-entropy of the layer stack's output against labels `y` in [0, hidden_dim)."""
        if len(self.linears) == 1:
            x = self.linears[0](x)
        else:
            for i, layer in enumerate(self.linears):
                x = self.linears[i // 2](x) + layer(x)
        return self.cross_entropy_loss(x, y)


def random_dataset(
    total_samples: int, hidden_dim: int, device: Any, dtype: torch.dtype | None = None
) -> torch.utils.data.TensorDataset:
    """Return `total_samples` randn inputs of width `hidden_dim` with integer labels in [0, hidden_dim).

    Args:
        total_samples: number of (input, label) pairs.
        hidden_dim: input width and number of classes.
        device: where the tensors live.
        dtype: input dtype; default preferred_dtype().
    """
    dtype = preferred_dtype() if dtype is None else dtype
    train_data = torch.randn(total_samples, hidden_dim, device=device, dtype=dtype)
    train_label = torch.empty(total_samples, dtype=torch.long, device=device).random_(hidden_dim)
    return torch.utils.data.TensorDataset(train_data, train_label)


def random_dataloader(
    model: Any, total_samples: int, hidden_dim: int, device: Any, dtype: torch.dtype | None = None
) -> torch.utils.data.DataLoader:
    """Return a DataLoader over random_dataset with the engine's micro-batch size.

    Args:
        model: the DeepSpeed engine (provides train_micro_batch_size_per_gpu()).
        total_samples: number of samples.
        hidden_dim: input width and number of classes.
        device: where the tensors live.
        dtype: input dtype; default preferred_dtype().
    """
    dataset = random_dataset(total_samples, hidden_dim, device, dtype=dtype)
    return torch.utils.data.DataLoader(dataset, batch_size=model.train_micro_batch_size_per_gpu())


def create_config_from_dict(tmpdir: Any, config_dict: dict[str, Any]) -> str:
    """Write `config_dict` to tmpdir/temp_config.json and return the path."""
    config_path = os.path.join(str(tmpdir), "temp_config.json")
    with open(config_path, "w") as fd:
        json.dump(config_dict, fd)
    return config_path


def create_deepspeed_args() -> argparse.Namespace:
    """Return launcher-style args: deepspeed=True and, inside a process group, local_rank = this rank.

    Raises:
        AssertionError: on a GPU host with more ranks than devices.
    """
    args = argparse.Namespace()
    args.deepspeed = True
    if dist.is_initialized():
        # CPU ranks share the host; only devices are one per rank.
        if get_accelerator().device_name() != "cpu":
            assert dist.get_world_size() <= get_accelerator().device_count()
        args.local_rank = dist.get_rank()
    return args


def args_from_dict(tmpdir: Any, config_dict: dict[str, Any]) -> argparse.Namespace:
    """Return create_deepspeed_args() pointing deepspeed_config at `config_dict` written to `tmpdir`."""
    args = create_deepspeed_args()
    args.deepspeed_config = create_config_from_dict(tmpdir, config_dict)
    return args
