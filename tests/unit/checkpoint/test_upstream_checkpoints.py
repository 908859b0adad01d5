"""A checkpoint written by upstream DeepSpeed 0.19.8 loads here and training continues as upstream's does.

The files under upstream_0.19.8/ were written by the release (see its README): 3 steps of TinyMLP on 2 ranks at
ZeRO-1, 2 and 3, Muon and AdamW, bf16 and fp16, then the checkpoint, then 3 more steps whose losses the release
recorded.
Here the checkpoint goes through deepspeed.checkpoint.from_upstream's command line (no pickled code of upstream's
is run: its objects load as data with `weights_only=True`; in rank 0 for every cell, and once as `python -m
deepspeed.checkpoint.from_upstream`, as users type it), loads into this fork's engine with the same config, and
the next 3 steps' losses are compared with upstream's own continuation: bf16 within one rounding of the loss
(1/128 relative), fp16 within two (1/512). Measured: equal in every cell but fp16 Muon, whose third loss differs by
one fp16 rounding (2.072265625 vs 2.07421875: upstream keeps Muon's momentum in fp16 and runs the iteration in
bf16, this fork in fp32). The fp16 cells also continue the loss scaler from upstream's file.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.checkpoint.upstream_form import load_upstream_file, read_upstream_checkpoint
from deepspeed.checkpoint.files import CheckpointError
from unit.common import DistributedTest
from unit.ops.muon.muon_suite import TinyMLP

FIXTURES = os.path.join(os.path.dirname(__file__), "upstream_0.19.8")
REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 3))
K, N, GLOBAL_BATCH = 3, 3, 16
CELLS = [f"zero{stage}-{optimizer}-{dtype}" for dtype in ("bf16", "fp16") for stage in (1, 2, 3)
         for optimizer in ("muon", "adamw")]
TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = {"bf16": 1 / 128, "fp16": 1 / 512}


def upstream_config(stage, optimizer, dtype):
    """tools/upstream_checkpoints.py's config (no clipping, Keller Jordan's iteration), loading the universal form."""
    params = {"lr": 0.05, "adam_lr": 0.01, "ns_method": "standard", "ns_dtype": "fp32"} if optimizer == "muon" \
        else {"lr": 0.01}
    return {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // 2, "gradient_clipping": 0.0, "steps_per_print": 10**6,
            "optimizer": {"type": "muon" if optimizer == "muon" else "AdamW", "params": params},
            "zero_optimization": {"stage": stage},
            dtype: {"enabled": True, **({"initial_scale_power": 8} if dtype == "fp16" else {})},
            "checkpoint": {"load_universal": True}}


def batches():
    """tools/upstream_checkpoints.py's batches: the ones after the checkpoint."""
    generator = torch.Generator().manual_seed(1234)
    data = [(torch.randn(GLOBAL_BATCH, 16, generator=generator),
             torch.randint(0, 8, (GLOBAL_BATCH, ), generator=generator)) for _ in range(K + N)]
    return data[K:]


def converter_arguments(directory) -> list:
    tag = os.path.join(directory, f"global_step{K}")
    return ["--input_folder", tag, "--output_folder", f"{tag}_universal"]


def convert_in_this_process(directory) -> None:
    """The command line's own entry, without a fresh interpreter (importing torch again costs 2 s a cell)."""
    from deepspeed.checkpoint import from_upstream

    from_upstream.main(from_upstream.parse_arguments(converter_arguments(directory)))


class TestUpstreamCheckpointContinues(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("cell", CELLS)
    def test_next_steps_equal_upstreams(self, cell, class_tmpdir):
        directory = os.path.join(str(class_tmpdir), cell)
        if dist.get_rank() == 0:
            shutil.copytree(os.path.join(FIXTURES, cell), directory)
            convert_in_this_process(directory)
        dist.barrier()
        stage, optimizer, dtype = int(cell[4]), cell.split("-")[1], cell.split("-")[2]
        torch.manual_seed(7)  # other initial weights: everything must come from the checkpoint
        engine, _, _, _ = deepspeed.initialize(model=TinyMLP(), config=upstream_config(stage, optimizer, dtype))
        load_path, _ = engine.load_checkpoint(directory)
        assert load_path is not None and engine.global_steps == K and engine.skipped_steps == 0
        rank, micro = dist.get_rank(), GLOBAL_BATCH // 2
        losses = []
        for x, y in batches():
            loss = engine(x[rank * micro:(rank + 1) * micro].to(engine.device, TORCH_DTYPE[dtype]),
                          y[rank * micro:(rank + 1) * micro].to(engine.device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.float().item())
        with open(os.path.join(FIXTURES, cell, f"continued_rank{rank}.json")) as f:
            upstream = json.load(f)
        assert losses == pytest.approx(upstream["losses"], rel=TOLERANCE[dtype]), \
            f"{cell}: ours {losses}, upstream 0.19.8 {upstream['losses']}"
        assert engine.skipped_steps == upstream["skipped_steps"] == 0


def test_the_command_line_converts(tmp_path):
    """`python -m deepspeed.checkpoint.from_upstream` as users type it: the universal folder and latest_universal."""
    shutil.copytree(os.path.join(FIXTURES, "zero2-muon-fp16"), tmp_path / "run")
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.from_upstream",
                             *converter_arguments(tmp_path / "run")], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    universal = tmp_path / "run" / f"global_step{K}_universal"
    assert f"Wrote {universal}" in result.stdout
    assert (tmp_path / "run" / "latest_universal").read_text().strip() == universal.name
    assert any(universal.iterdir())


def test_the_mapping_of_upstream_fields():
    model_state, full = read_upstream_checkpoint(os.path.join(FIXTURES, "zero2-muon-bf16", f"global_step{K}"))
    assert model_state["global_steps"] == K and model_state["precision"] == "bf16"
    assert model_state["zero_stage"] == 2 and model_state["dp_world_size"] == 2
    muon, adam = full.groups
    assert muon.names == ["fc1.weight", "fc2.weight", "fc3.weight"]  # the model file's param_shapes order
    assert muon.hyperparameters["use_muon"] and muon.hyperparameters["ns_steps"] == 5  # this fork's default added
    assert muon.hyperparameters["ns_method"] == "standard"  # what upstream saved
    for index, shape in enumerate(muon.shapes):
        momentum = muon.states[index].tensors["momentum_buffer"]
        assert momentum.dtype == torch.float32 and momentum.numel() == shape.numel()
        assert muon.masters[index].dtype == torch.float32 and not muon.masters[index].requires_grad
    assert set(adam.states[0].tensors) == {"exp_avg", "exp_avg_sq"}
    assert float(adam.states[0].scalars["step"]) == K
    assert full.loss_scaler == {"type": "static", "cur_scale": 1.0}
    # fp16: upstream's momentum is of the loss-scaled gradient; converted, it is the same run's momentum as in bf16.
    _, fp16 = read_upstream_checkpoint(os.path.join(FIXTURES, "zero2-muon-fp16", f"global_step{K}"))
    assert fp16.loss_scaler["type"] == "dynamic" and fp16.loss_scaler["cur_scale"] == 256
    for index in range(len(muon.shapes)):
        bf16_norm = muon.states[index].tensors["momentum_buffer"].norm().item()
        fp16_norm = fp16.groups[0].states[index].tensors["momentum_buffer"].norm().item()
        assert fp16_norm == pytest.approx(bf16_norm, rel=0.02)
    # ZeRO-3: each parameter split on its own; the weights come from the masters (the model file holds placeholders).
    stage3_state, stage3 = read_upstream_checkpoint(os.path.join(FIXTURES, "zero3-muon-bf16", f"global_step{K}"))
    assert stage3.zero_stage == 3 and stage3.groups[0].names == muon.names
    matrices = stage3.groups[0]
    for index, name in enumerate(matrices.names):
        assert stage3_state["module"][name].shape == matrices.shapes[index]
        assert stage3_state["module"][name].dtype == torch.bfloat16
        assert matrices.states[index].tensors["momentum_buffer"].numel() == matrices.shapes[index].numel()


def test_refusals_name_what_cannot_be_read(tmp_path):
    # Loading without converting names the conversion.
    with pytest.raises(CheckpointError, match="from_upstream"):
        from deepspeed.checkpoint.engine_io import _check_model_file
        model_file = os.path.join(FIXTURES, "zero2-adamw-bf16", f"global_step{K}", "mp_rank_00_model_states.pt")
        _check_model_file(None, load_upstream_file(model_file), model_file, True)
    # A missing rank file is named.
    partial = tmp_path / "partial"
    shutil.copytree(os.path.join(FIXTURES, "zero3-muon-bf16", f"global_step{K}"), partial)
    os.remove(partial / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointError, match="bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt does not exist"):
        read_upstream_checkpoint(str(partial))
    # A file holding any other class is refused, naming it, without running it.
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {}, "hook": Unexpected()}, path)
    with pytest.raises(CheckpointError, match=r"cannot be read without running its code.*Unexpected"):
        load_upstream_file(str(path))


class Unexpected:
    """Stands for any class a checkpoint file could name."""
