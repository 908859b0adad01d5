#!/usr/bin/env python
"""Consolidate a DeepSpeed ZeRO (stage 0-2) checkpoint's fp32 masters into one plain PyTorch state_dict.

Usage:
    python zero_to_fp32.py <checkpoint_dir> <output_dir> [-t TAG]
writes <output_dir>/pytorch_model.bin, which `model.load_state_dict(torch.load(path))` accepts.

This file depends only on torch so that it can run from the copy placed next to each checkpoint.
"""

import argparse
import glob
import os
import re
from collections import OrderedDict
from typing import Optional

import torch

MODEL_FILE = "mp_rank_00_model_states.pt"
OPTIM_PATTERN = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


def _load(path: str) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 -- torch raises several types for corrupt files
        raise ValueError(f"cannot load {path}: {type(exc).__name__}: {exc}") from exc


def _tag_dir(checkpoint_dir: str, tag: Optional[str]) -> str:
    if tag is None:
        latest = os.path.join(checkpoint_dir, "latest")
        if not os.path.isfile(latest):
            raise ValueError(f"no 'latest' file in {checkpoint_dir}; pass the tag explicitly (-t TAG)")
        with open(latest) as f:
            tag = f.read().strip()
    return os.path.join(checkpoint_dir, tag)


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: Optional[str] = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> "OrderedDict[str, torch.Tensor]":
    """Rebuild every trainable parameter from the fp32 master partitions; other module entries from the
    saved module state (frozen parameters and buffers, upcast to fp32 when floating point).

    Raises:
        ValueError: missing or inconsistent files (the message names them).
    """
    tag_dir = _tag_dir(checkpoint_dir, tag)
    model_state = _load(os.path.join(tag_dir, MODEL_FILE))
    world = model_state["dp_world_size"]
    files = {}
    for path in glob.glob(os.path.join(tag_dir, "*_optim_states.pt")):
        match = OPTIM_PATTERN.match(os.path.basename(path))
        if match:
            files[int(match.group(2))] = path
    if sorted(files) != list(range(world)):
        raise ValueError(f"Expected {world} of '*_optim_states.pt' under '{tag_dir}' but found {len(files)} files. "
                         "Possibly due to an overwrite of an old checkpoint, or a checkpoint didn't get saved by "
                         "one or more processes.")
    partitions = [_load(files[r])["optimizer_state_dict"] for r in range(world)]
    result: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for group_index, names_and_shapes in enumerate(model_state["param_shapes"]):
        layout = partitions[0]["layouts"][group_index]
        if layout["num_partitions"] == 1:
            flat = partitions[0]["single_partition_of_fp32_groups"][group_index]
        else:
            flat = torch.cat([partitions[r]["single_partition_of_fp32_groups"][group_index] for r in range(world)])
        for index, (name, shape) in enumerate(names_and_shapes):
            start = layout["param_offsets"][index]
            numel = layout["numels"][index]
            result[name] = flat[start:start + numel].clone().view(shape)
    trainable = set(result)
    for name, value in model_state["module"].items():
        if name in trainable:
            continue
        if exclude_frozen_parameters and name not in model_state.get("buffer_names", []):
            continue
        result[name] = value.float() if value.is_floating_point() else value
    return OrderedDict((name, result[name]) for name in model_state["module"] if name in result)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_dir: str, max_shard_size: str = "5GB",
                                               safe_serialization: bool = False, tag: Optional[str] = None,
                                               exclude_frozen_parameters: bool = False) -> str:
    """Write the consolidated state dict to <output_dir>/pytorch_model.bin and return its path."""
    if safe_serialization:
        raise ValueError("safe_serialization needs the safetensors package, which this build does not use")
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "pytorch_model.bin")
    torch.save(state, path)
    return path


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str,
                                         tag: Optional[str] = None) -> torch.nn.Module:
    """Load the consolidated fp32 weights into `model` (moved to CPU) and return it."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("checkpoint_dir", help="folder holding 'latest' and the tag folders")
    parser.add_argument("output_dir", help="folder for pytorch_model.bin")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: the one in 'latest')")
    parser.add_argument("--max_shard_size", default="5GB")
    parser.add_argument("--safe_serialization", action="store_true")
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("-d", "--debug", action="store_true")
    args = parser.parse_args(argv)
    path = convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir, args.max_shard_size,
                                                      args.safe_serialization, args.tag,
                                                      args.exclude_frozen_parameters)
    print(f"Saved fp32 state dict to {path}")


if __name__ == "__main__":
    main()
