#!/usr/bin/env python
"""Convert a ZeRO checkpoint (stages 0-3, saved at any world size) to the universal form: one file per parameter
for the fp32 master and for each optimizer-state tensor (Adam's moments and step, Muon's momentum).

Usage (upstream's command and arguments):
    python -m deepspeed.checkpoint.ds_to_universal --input_folder <dir>/<tag> --output_folder <dir>/<tag>_universal
writes <dir>/<tag>_universal/ (layout: deepspeed/checkpoint/universal.py) and <dir>/latest_universal, which an
engine with `"checkpoint": {"load_universal": true}` loads at any world size. It runs in one process, without
torch.distributed; `--num_extract_workers`, `--num_merge_workers`, `--keep_temp_folder`, `--no_strict` and
`--inject_missing_state` are accepted for compatibility and change nothing (the checks always run).
"""

import argparse
import os
from typing import List, Optional

from deepspeed.checkpoint.universal import is_universal, read_rank_files, write_universal
from deepspeed.checkpoint.files import (LATEST_UNIVERSAL_FILE, CheckpointError, atomic_write_text,
                                                find_model_file, load_file, missing_files)


def convert(input_folder: str, output_folder: str) -> str:
    """Write the universal form of the checkpoint in `input_folder` to `output_folder`; returns `output_folder`.

    `latest_universal` in `output_folder`'s parent then names it. A failed conversion writes neither.

    Raises:
        CheckpointError: naming the file: a missing, truncated, corrupted or inconsistent file of the checkpoint,
            or a checkpoint that is already universal.
    """
    input_folder, output_folder = os.path.normpath(str(input_folder)), os.path.normpath(str(output_folder))
    model_path = find_model_file(input_folder)
    model_state = load_file(model_path)
    required = ("param_shapes", "optimizer_files", "zero_stage", "dp_world_size")
    missing = [key for key in required if key not in model_state]
    if missing:
        raise CheckpointError(f"checkpoint file {model_path}: missing keys {missing}; not a checkpoint of this "
                              "DeepSpeed")
    if is_universal(model_state):
        raise CheckpointError(f"checkpoint file {model_path} belongs to a universal checkpoint already")
    if os.path.abspath(input_folder) == os.path.abspath(output_folder):
        raise CheckpointError(f"--output_folder must differ from --input_folder ({input_folder})")
    missing = missing_files(input_folder, model_state)
    if missing:
        raise CheckpointError(f"checkpoint {input_folder} is incomplete and is not converted; missing files: "
                              f"{missing}")
    full, rng_states = read_rank_files(input_folder, model_state)
    write_universal(output_folder, model_state, full, rng_states, source=os.path.basename(input_folder))
    parent = os.path.dirname(os.path.abspath(output_folder))
    atomic_write_text(os.path.join(parent, LATEST_UNIVERSAL_FILE), os.path.basename(output_folder))
    return output_folder


def parse_arguments(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Convert a DeepSpeed ZeRO checkpoint to the universal "
                                     "(per-parameter) form, loadable at any world size")
    parser.add_argument("--input_folder", type=str, required=True, help="the checkpoint's tag folder, <dir>/<tag>")
    parser.add_argument("--output_folder", type=str, required=True, help="the universal checkpoint's folder, "
                        "usually <dir>/<tag>_universal; latest_universal is written next to it")
    one_process = "accepted; the conversion runs in one process"
    parser.add_argument("--num_extract_workers", default=4, type=int, help=one_process)
    parser.add_argument("--num_merge_workers", default=2, type=int, help=one_process)
    parser.add_argument("--keep_temp_folder", action="store_true", help="accepted; no fragment files are written")
    parser.add_argument("--no_strict", dest="strict", action="store_false", help="accepted; the checks always run")
    parser.add_argument("--inject_missing_state", action="store_true", help="accepted; nothing needs injecting")
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> None:
    """Upstream's entry point: convert `args.input_folder` into `args.output_folder`."""
    print(f"Converting DeepSpeed checkpoint in {args.input_folder} to Universal checkpoint in {args.output_folder}")
    output = convert(args.input_folder, args.output_folder)
    print(f"Wrote {output} and {os.path.join(os.path.dirname(os.path.abspath(output)), LATEST_UNIVERSAL_FILE)}")


if __name__ == "__main__":
    main(parse_arguments())
