#!/usr/bin/env python3
"""Bytes of optimizer state MuonWithAuxAdam keeps for a GPT, per Muon option (momentum_dtype, NorMuon).

The optimizer is the one training uses: built from the DeepSpeed config's `optimizer.params` (muon_param_groups) on
the model tagged by the default parameter split, and stepped once, so every state tensor it keeps exists, with its
shape and dtype. The model lives on torch's meta device (no memory, no arithmetic), so the 1.11B model is counted on
any machine in seconds. The bytes are the whole model's: under ZeRO each rank keeps its share of them.

    python benchmarks/muon_state_bytes.py [--sizes gpt2-small,1.1b] [--out DIR]

Writes `<out>/muon_state_bytes.json` (provenance, per size and option: bytes per state key and dtype) and
`muon_state_bytes.md` (the table).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt_model import GPT, GPT2_SMALL, GPT_1_1B, GPTConfig  # noqa: E402
from provenance import provenance  # noqa: E402

import deepspeed  # noqa: E402
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam, muon_param_groups  # noqa: E402

SIZES = {
    "gpt2-small": GPT2_SMALL,
    "1.1b": GPT_1_1B,
}
OPTIONS = {
    "muon (fp32 momentum)": {},
    "muon, momentum_dtype bf16": {"momentum_dtype": "bf16"},
    "normuon": {"normuon": True},
    "normuon, momentum_dtype bf16": {"normuon": True, "momentum_dtype": "bf16"},
}
GIB = 2**30


def state_bytes(config: GPTConfig, options: dict) -> dict:
    """{"params": ..., "muon_params": ..., "state": {"<key> <dtype>": bytes}} after one step of the optimizer."""
    with torch.device("meta"):
        model = GPT(config)
    deepspeed.tag_muon_params(model)
    optimizer = MuonWithAuxAdam(muon_param_groups(model.named_parameters(), {"ns_dtype": "fp32", **options}))
    for param in model.parameters():
        param.grad = torch.empty_like(param)
    optimizer.step()
    state: dict[str, int] = {}
    for values in optimizer.state.values():
        for key, value in values.items():
            if torch.is_tensor(value):
                name = f"{key} {str(value.dtype).removeprefix('torch.')}"
                state[name] = state.get(name, 0) + value.numel() * value.element_size()
    return {"params": sum(p.numel() for p in model.parameters()),
            "muon_params": sum(p.numel() for p in model.parameters() if p.use_muon), "state": state}


def table(results: dict) -> str:
    lines = ["| model | option | Muon momentum GiB | other Muon state GiB | Adam state GiB | all state GiB |",
             "|---|---|---|---|---|---|"]
    for size, by_option in results["sizes"].items():
        for option, counted in by_option.items():
            state = counted["state"]
            momentum = sum(v for k, v in state.items() if k.startswith("momentum_buffer"))
            adam = sum(v for k, v in state.items() if k.split()[0] in ("exp_avg", "exp_avg_sq", "step"))
            other = sum(state.values()) - momentum - adam
            lines.append(f"| {size} | {option} | {momentum / GIB:.3f} | {other / GIB:.4f} | {adam / GIB:.3f} | "
                         f"{sum(state.values()) / GIB:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {list(SIZES)}")
    parser.add_argument("--out", default=".")
    args = parser.parse_args(argv)
    meta = provenance()
    results = {"meta": meta, "sizes": {}}
    for size in args.sizes.split(","):
        results["sizes"][size] = {option: state_bytes(SIZES[size], options) for option, options in OPTIONS.items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "muon_state_bytes.json").write_text(json.dumps(results, indent=1))
    header = "\n".join(f"<!-- {key}: {meta[key]} -->" for key in ("command", "commit", "machine", "date"))
    text = f"{header}\n\nOptimizer state of MuonWithAuxAdam after one step, whole model (bytes / 2^30).\n\n" \
           f"{table(results)}\n"
    (out / "muon_state_bytes.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
