"""Runtime helpers upstream exposes under `deepspeed.runtime.utils` that clients call (accelerate's scripts)."""

from typing import Any, Callable

import torch


def move_to_device(item: Any, device: torch.device, criterion_func: Callable[[torch.Tensor], bool] = None) -> Any:
    """Return `item` with every tensor moved to `device`, through nested lists, tuples and dicts.

    Args:
        item: a tensor or a nesting of lists, tuples and dicts holding tensors; other values are returned as they are.
        device: where the tensors go.
        criterion_func: when given, only tensors for which it returns True are moved (upstream's argument).
    """
    if torch.is_tensor(item):
        return item.to(device) if criterion_func is None or criterion_func(item) else item
    if isinstance(item, list):
        return [move_to_device(value, device, criterion_func) for value in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(value, device, criterion_func) for value in item)
    if isinstance(item, dict):
        return {key: move_to_device(value, device, criterion_func) for key, value in item.items()}
    return item
