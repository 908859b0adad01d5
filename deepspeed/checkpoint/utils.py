"""Checkpoint helpers upstream exposes under `deepspeed.checkpoint.utils` (accelerate calls the one below)."""

from typing import Any

import torch


def clone_tensors_for_torch_save(item: Any, device: torch.device = torch.device("cpu")) -> Any:
    """Return a copy of `item` whose tensors are detached clones on `device`, ready for `torch.save`.

    A tensor that is a view of a larger storage (a parameter inside a flat buffer) would make `torch.save` write the
    whole storage; a clone holds only its own elements. Dicts, lists and tuples are copied with their structure
    (an OrderedDict stays one); anything else is returned as it is.

    Args:
        item: a tensor, or a dict / list / tuple nesting tensors (e.g. a module's `state_dict()`).
        device: where the clones live (CPU by default).
    """
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, dict):
        copied = type(item)() if type(item) is not dict else {}
        for key, value in item.items():
            copied[key] = clone_tensors_for_torch_save(value, device)
        return copied
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(value, device) for value in item)
    return item
