"""The random generators' states each rank saves in its optimizer file and gets back on load (torch, Python's
`random`, the accelerator's), as plain data."""

import random

import torch

from deepspeed.accelerator import get_accelerator


def rng_state() -> dict:
    version_, internal, gauss = random.getstate()
    state = {"torch": torch.get_rng_state(), "python": [version_, list(internal), gauss]}
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        state["accelerator"] = accelerator.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    # torch and CUDA take their generator states as CPU byte tensors.
    torch.set_rng_state(state["torch"].cpu())
    version_, internal, gauss = state["python"]
    random.setstate((version_, tuple(internal), gauss))
    if "accelerator" in state and get_accelerator().device_name() != "cpu":
        get_accelerator().set_rng_state(state["accelerator"].cpu())
