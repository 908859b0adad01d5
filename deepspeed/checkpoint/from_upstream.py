#!/usr/bin/env python
"""Convert a ZeRO-1/2 checkpoint written by upstream DeepSpeed (0.19.x) into this fork's universal form.

Usage:
    python -m deepspeed.checkpoint.from_upstream --input_folder <dir>/<tag> --output_folder <dir>/<tag>_universal
writes <dir>/<tag>_universal/ and <dir>/latest_universal; an engine with `"checkpoint": {"load_universal": true}`
then loads it (at any world size and ZeRO stage) and training continues where upstream stopped. Upstream's files
are read without running any of their pickled code (deepspeed/checkpoint/upstream_form.py has the mapping).
"""

import argparse
import os
from typing import List, Optional

from deepspeed.checkpoint.universal import write_universal
from deepspeed.checkpoint.upstream_form import read_upstream_checkpoint
from deepspeed.checkpoint.files import (CHECKPOINT_FORMAT, LATEST_UNIVERSAL_FILE, CheckpointError,
                                                atomic_write_text)


def convert(input_folder: str, output_folder: str) -> str:
    """Write the universal form of the upstream checkpoint in `input_folder` to `output_folder`; returns it.

    Raises:
        CheckpointError: naming the file and field that cannot be read or mapped (see upstream_form.py).
    """
    input_folder, output_folder = os.path.normpath(str(input_folder)), os.path.normpath(str(output_folder))
    if os.path.abspath(input_folder) == os.path.abspath(output_folder):
        raise CheckpointError(f"--output_folder must differ from --input_folder ({input_folder})")
    model_state, full = read_upstream_checkpoint(input_folder)
    model_state["format"] = CHECKPOINT_FORMAT
    write_universal(output_folder, model_state, full, rng_states=[],
                    source=f"upstream DeepSpeed {model_state['ds_version']}: {os.path.basename(input_folder)}")
    parent = os.path.dirname(os.path.abspath(output_folder))
    atomic_write_text(os.path.join(parent, LATEST_UNIVERSAL_FILE), os.path.basename(output_folder))
    return output_folder


def parse_arguments(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Convert an upstream DeepSpeed ZeRO-1/2 checkpoint to this fork's "
                                     "universal form")
    parser.add_argument("--input_folder", type=str, required=True, help="the upstream checkpoint's tag folder")
    parser.add_argument("--output_folder", type=str, required=True,
                        help="the universal checkpoint's folder; latest_universal is written next to it")
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> None:
    output = convert(args.input_folder, args.output_folder)
    print(f"Wrote {output} and {os.path.join(os.path.dirname(os.path.abspath(output)), LATEST_UNIVERSAL_FILE)}")


if __name__ == "__main__":
    main(parse_arguments())
