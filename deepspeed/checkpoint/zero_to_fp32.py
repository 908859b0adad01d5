#!/usr/bin/env python
"""Consolidate a DeepSpeed ZeRO (stage 0-2) checkpoint's fp32 masters into one plain PyTorch state_dict.

Usage:
    python zero_to_fp32.py <checkpoint_dir> <output_dir> [-t TAG] [--exclude_frozen_parameters]
    python -m deepspeed.utils.zero_to_fp32 <checkpoint_dir> <output_dir> [-t TAG]   (upstream's path; this module)
writes <output_dir>/pytorch_model.bin, which `model.load_state_dict(torch.load(path))` accepts.

Every trainable parameter comes from the fp32 master partitions of the `*_optim_states.pt` files;
frozen parameters and buffers come from the model-states file (floating point ones upcast to fp32), as does
every parameter of a checkpoint saved by an engine without an optimizer (stage 3 forward only: nothing partitioned).
This file depends only on torch so that it runs from the copy placed next to each checkpoint, and it
reads with torch.load(weights_only=True).
"""

import argparse
import os
from collections import OrderedDict
from typing import Optional

import torch

MODEL_FILE = "mp_rank_00_model_states.pt"
# Stage 3 writes one model file per data-parallel rank; rank 0's names the parameters like MODEL_FILE does.
STAGE3_MODEL_FILE = "zero_pp_rank_0_mp_rank_00_model_states.pt"
OUTPUT_FILE = "pytorch_model.bin"


def _load(path: str) -> dict:
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint file {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 -- torch raises several types for corrupt files
        raise ValueError(f"checkpoint file {path} cannot be loaded: {type(exc).__name__}: {exc}") from exc


def _tag_dir(checkpoint_dir: str, tag: Optional[str]) -> str:
    if tag is None:
        latest = os.path.join(checkpoint_dir, "latest")
        if not os.path.isfile(latest):
            raise ValueError(f"Unable to find 'latest' file at {latest}; pass the tag explicitly (-t TAG)")
        with open(latest) as f:
            tag = f.read().strip()
    tag_dir = os.path.join(checkpoint_dir, str(tag))
    if not os.path.isdir(tag_dir):
        raise ValueError(f"Directory '{tag_dir}' doesn't exist. Maybe the tag is wrong")
    return tag_dir


def _optim_files(tag_dir: str, model_state: dict) -> list:
    names = model_state.get("optimizer_files", [])
    found = [name for name in names if os.path.isfile(os.path.join(tag_dir, name))]
    if not names or len(found) != len(names):
        raise ValueError(f"Expected {len(names)} of '*_optim_states.pt' under '{tag_dir}' but found {len(found)} "
                         "files. Possibly due to an overwrite of an old checkpoint, or a checkpoint didn't get saved "
                         f"by one or more processes. Missing: {sorted(set(names) - set(found))}")
    return [os.path.join(tag_dir, name) for name in names]


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: Optional[str] = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> "OrderedDict[str, torch.Tensor]":
    """Rebuild the model's state dict in fp32 from a checkpoint, in the module's key order.

    Args:
        checkpoint_dir: the folder holding `latest` and the tag folders.
        tag: the tag to read (default: the one in `latest`).
        exclude_frozen_parameters: leave out parameters that were not trained.
        lazy_mode: accepted for compatibility; tensors are always materialised.

    Raises:
        ValueError: missing, unreadable or inconsistent files (the message names them).
    """
    tag_dir = _tag_dir(checkpoint_dir, tag)
    model_path = os.path.join(tag_dir, MODEL_FILE)
    if not os.path.isfile(model_path) and os.path.isfile(os.path.join(tag_dir, STAGE3_MODEL_FILE)):
        model_path = os.path.join(tag_dir, STAGE3_MODEL_FILE)
    model_state = _load(model_path)
    if not model_state.get("optimizer_files") and not model_state.get("param_shapes"):
        # An engine without an optimizer (stage 3 forward only, e.g. the Trainer's evaluate): nothing was
        # partitioned, its model file holds every parameter whole.
        partitions = []
    else:
        partitions = [_load(path)["optimizer_state_dict"] for path in _optim_files(tag_dir, model_state)]
    trainable: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for group_index, shapes in enumerate(model_state["param_shapes"]):
        layout = partitions[0]["layouts"][group_index]
        masters = [partition["single_partition_of_fp32_groups"][group_index] for partition in partitions]
        # One partition (stage 0) is replicated on every rank; otherwise rank r holds slice r of the flat group.
        flat = masters[0] if layout["num_partitions"] == 1 else torch.cat(masters)
        if flat.numel() != layout["partition_size"] * layout["num_partitions"]:
            raise ValueError(f"fp32 masters of group {group_index} under '{tag_dir}' hold {flat.numel()} elements, "
                             f"the layout expects {layout['partition_size'] * layout['num_partitions']}")
        for index, (name, shape) in enumerate(shapes.items()):
            start, numel = layout["param_offsets"][index], layout["numels"][index]
            trainable[name] = flat[start:start + numel].clone().view(shape)
    for alias, source in model_state.get("shared_params", {}).items():
        if source in trainable:
            trainable[alias] = trainable[source]
    buffer_names = set(model_state.get("buffer_names", []))
    result: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for name, value in model_state["module"].items():
        if name in trainable:
            result[name] = trainable[name]
        elif name in buffer_names or not exclude_frozen_parameters:
            result[name] = value.float() if value.is_floating_point() else value
    return result


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_dir: str, max_shard_size: str = "5GB",
                                               safe_serialization: bool = False, tag: Optional[str] = None,
                                               exclude_frozen_parameters: bool = False) -> str:
    """Write the consolidated state dict to <output_dir>/pytorch_model.bin (one file) and return its path.

    Raises:
        ValueError: as get_fp32_state_dict_from_zero_checkpoint, or `safe_serialization` (not supported).
    """
    if safe_serialization:
        raise ValueError("safe_serialization needs the safetensors package, which this build does not use")
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, OUTPUT_FILE)
    torch.save(state, path)
    return path


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str,
                                         tag: Optional[str] = None) -> torch.nn.Module:
    """Load the consolidated fp32 weights into `model` (moved to the CPU) and return it."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Consolidate a DeepSpeed ZeRO checkpoint's fp32 masters into "
                                     f"<output_dir>/{OUTPUT_FILE}")
    parser.add_argument("checkpoint_dir", help="folder holding 'latest' and the tag folders")
    parser.add_argument("output_dir", help=f"folder for {OUTPUT_FILE}")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: the one in 'latest')")
    parser.add_argument("--max_shard_size", default="5GB", help="accepted for compatibility; one file is written")
    parser.add_argument("--safe_serialization", action="store_true", help="not supported")
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("-d", "--debug", action="store_true")
    args = parser.parse_args(argv)
    path = convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir, args.max_shard_size,
                                                      args.safe_serialization, args.tag,
                                                      args.exclude_frozen_parameters)
    print(f"Saved fp32 state dict to {path}")


if __name__ == "__main__":
    main()
