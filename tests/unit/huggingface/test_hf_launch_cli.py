"""The two command lines users start ZeRO-3 + CPU-offload training with, run for real on 2 CPU processes.

- `accelerate launch --config_file <yaml> train.py` (accelerate starts the ranks through torch.distributed.run): the
  YAML `accelerate config` writes for DeepSpeed (ZeRO-3, optimizer and parameters offloaded to the CPU,
  `zero3_init_flag`, `zero3_save_16bit_model`, accumulation 2, clipping 1.0, bf16) with the script's torch AdamW
  (accelerate swaps in DeepSpeedCPUAdam), and a YAML naming a `deepspeed_config_file` whose optimizer is Muon.
  A raw accelerate loop: prepare, backward/step, `save_state`, `get_state_dict`, `save_model`, `load_state` (in the
  same processes, and in a second launch).
- `deepspeed --num_gpus 2 train.py --deepspeed ds_config_zero3.json` (here `python -m deepspeed.launcher.runner`):
  a Trainer script with the transformers guide's ZeRO-3 offload config, Muon as its optimizer; trains with a
  checkpoint halfway and saves, then a second launch resumes from that checkpoint.

Each run is compared with the single-process torch reference of hf_harness.py (the same saved weights, batches and
optimizer), and a resumed or reloaded run with the uninterrupted one bit for bit. Without a GPU accelerate counts one
process under DeepSpeed unless the script names the gloo backend (docs/huggingface.md); the scripts do, as users do.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from unit.python_process import free_port

from hf_harness import (ADAM_EPS, MUON_LR, TokenDataset, assert_changes_match, bf16_rounded,
                        guide_zero3_offload_config, llama_config, reference_training, step_batches, transformers,
                        warmup_lrs)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))

# The warmup lasts the whole run, so that a reload that missed the scheduler's state trains differently.
WORLD, MICRO, GAS, STEPS, SAVE_AT, WARMUP = 2, 2, 2, 6, 3, 6
LR, WEIGHT_DECAY, CLIP, BETAS = 3e-3, 0.01, 1.0, (0.9, 0.999)

ACCELERATE_SCRIPT = textwrap.dedent("""
    import os
    import sys

    import accelerate
    import torch
    import transformers
    from accelerate.utils import DummyOptim, DummyScheduler, InitProcessGroupKwargs

    from hf_harness import ADAM_EPS, TokenDataset, accelerate_train, full_fp32_params

    model_dir, out, resume = sys.argv[1], sys.argv[2], sys.argv[3:]  # resume: the saved state to continue from
    MICRO, STEPS, SAVE_AT, WARMUP, LR, WEIGHT_DECAY = 2, 6, 3, 6, 3e-3, 0.01
    # Without a GPU accelerate picks no backend for DeepSpeed and would count one process.
    accelerator = accelerate.Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    partitioned = hasattr(next(model.parameters()), "ds_id")
    loader = torch.utils.data.DataLoader(TokenDataset(), batch_size=MICRO, shuffle=False)
    if "optimizer" in accelerator.state.deepspeed_plugin.deepspeed_config:  # the config file's Muon and WarmupLR
        optimizer = DummyOptim(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        scheduler = DummyScheduler(optimizer, warmup_num_steps=WARMUP)
        engine, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    else:  # accelerate swaps this AdamW for DeepSpeedCPUAdam under optimizer offload
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, eps=ADAM_EPS)
        scheduler = None
        engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    gas = engine.gradient_accumulation_steps()


    def rest_of_the_run():
        remaining = accelerator.skip_first_batches(loader, SAVE_AT * gas)
        return accelerate_train(accelerator, engine, optimizer, remaining, STEPS - SAVE_AT, gas, scheduler)


    if resume:
        accelerator.load_state(resume[0])
        resumed_at = engine.global_steps
        record = {"resumed_at": resumed_at, "losses": rest_of_the_run(), "params": full_fp32_params(engine)}
        if accelerator.is_main_process:
            torch.save(record, os.path.join(out, "resumed.pt"))
    else:
        losses = accelerate_train(accelerator, engine, optimizer, loader, SAVE_AT, gas, scheduler)
        accelerator.save_state(os.path.join(out, "state"))
        losses += rest_of_the_run()
        params = full_fp32_params(engine)
        exported = accelerator.get_state_dict(engine)
        accelerator.save_model(engine, os.path.join(out, "exported"))
        accelerator.load_state(os.path.join(out, "state"))
        resumed_at = engine.global_steps
        reloaded = rest_of_the_run()
        reloaded_params = full_fp32_params(engine)
        if accelerator.is_main_process:
            torch.save({"processes": accelerator.num_processes, "partitioned": partitioned,
                        "stage": engine.zero_optimization_stage(), "gas": gas, "clip": engine.gradient_clipping(),
                        "offloaded": bool(engine.optimizer.cpu_offload and engine.optimizer.placement.is_offloaded),
                        "optimizer": type(engine.basic_optimizer).__name__, "bf16": engine.bfloat16_enabled(),
                        "losses": losses, "params": params, "exported": {k: v.clone() for k, v in exported.items()},
                        "resumed_at": resumed_at, "reloaded_losses": reloaded, "reloaded_params": reloaded_params},
                       os.path.join(out, "run.pt"))
    # Destroys the gloo process group: a rank that exits with it alive may abort in torch's teardown.
    accelerator.end_training()
""")

# The YAML `accelerate config` writes for DeepSpeed with ZeRO-3 and both offloads to the CPU.
ACCELERATE_CONFIG_YAML = textwrap.dedent("""
    compute_environment: LOCAL_MACHINE
    debug: false
    deepspeed_config:
      gradient_accumulation_steps: 2
      gradient_clipping: 1.0
      offload_optimizer_device: cpu
      offload_param_device: cpu
      zero3_init_flag: true
      zero3_save_16bit_model: true
      zero_stage: 3
    distributed_type: DEEPSPEED
    downcast_bf16: 'no'
    enable_cpu_affinity: false
    machine_rank: 0
    main_training_function: main
    mixed_precision: bf16
    num_machines: 1
    num_processes: 2
    rdzv_backend: static
    same_network: true
    tpu_env: []
    tpu_use_cluster: false
    tpu_use_sudo: false
    use_cpu: false
""")

# The same with a DeepSpeed config file (accelerate then takes everything but zero3_init_flag from the file).
ACCELERATE_CONFIG_FILE_YAML = textwrap.dedent("""
    compute_environment: LOCAL_MACHINE
    deepspeed_config:
      deepspeed_config_file: ds.json
      zero3_init_flag: true
    distributed_type: DEEPSPEED
    machine_rank: 0
    main_training_function: main
    num_machines: 1
    num_processes: 2
    rdzv_backend: static
    same_network: true
    use_cpu: false
""")

TRAINER_SCRIPT = textwrap.dedent("""
    import os

    import accelerate
    import torch
    import transformers

    from hf_harness import TokenDataset, full_fp32_params

    # Without a GPU accelerate picks no backend for DeepSpeed and would count one process: configure the state with
    # gloo and pass --accelerator_config '{"use_configured_state": true}'.
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    accelerate.PartialState(backend="gloo")
    parser = transformers.HfArgumentParser(transformers.TrainingArguments)
    args, rest = parser.parse_args_into_dataclasses(return_remaining_strings=True)
    model_dir, resume = rest[0], (rest[1] if len(rest) > 1 else None)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    partitioned = hasattr(next(model.parameters()), "ds_id")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenDataset())
    trainer.train(resume_from_checkpoint=resume)
    engine = trainer.model_wrapped
    params = full_fp32_params(engine)
    trainer.save_model(os.path.join(args.output_dir, "exported"))
    if trainer.is_world_process_zero():
        torch.save({"processes": args.world_size, "partitioned": partitioned,
                    "stage": engine.zero_optimization_stage(),
                    "offloaded": bool(engine.optimizer.cpu_offload and engine.optimizer.placement.is_offloaded),
                    "optimizer": type(engine.basic_optimizer).__name__, "global_steps": engine.global_steps,
                    "losses": {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry},
                    "params": params}, os.path.join(args.output_dir, "run.pt"))
    # A rank that exits with the gloo process group alive may abort in torch's teardown.
    torch.distributed.destroy_process_group()
""")


def cpu_env() -> dict:
    """The launchers' environment: the CPU accelerator and no GPU (on a GPU machine accelerate would put the batches
    on one), one thread per rank, this tree and the harness importable, no accelerate settings from the calling
    process."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("ACCELERATE_")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, HERE, env.get("PYTHONPATH")]))
    return env


def run_cli(cmd: list, cwd) -> None:
    result = subprocess.run(cmd, check=False, cwd=cwd, env=cpu_env(), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]


def save_initial_model(directory) -> str:
    path = os.path.join(str(directory), "init")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(llama_config()).save_pretrained(path)
    return path


def initial_weights(model_dir: str) -> dict:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def read_safetensors(directory: str) -> dict:
    from safetensors.torch import load_file
    return load_file(os.path.join(directory, "model.safetensors"))


@pytest.mark.parametrize("variant", ["accelerate_config", "config_file_muon"])
def test_accelerate_launch_zero3_offload(variant, tmp_path):
    model_dir = save_initial_model(tmp_path)
    if variant == "accelerate_config":
        (tmp_path / "accelerate.yaml").write_text(ACCELERATE_CONFIG_YAML)
    else:
        config = guide_zero3_offload_config("Muon")
        # A raw accelerate loop fills "auto" only where it knows the value: betas and eps are written out.
        config["optimizer"]["params"].update(betas=list(BETAS), eps=ADAM_EPS)
        config.update(gradient_accumulation_steps=GAS, gradient_clipping=CLIP)
        (tmp_path / "ds.json").write_text(json.dumps(config))
        (tmp_path / "accelerate.yaml").write_text(ACCELERATE_CONFIG_FILE_YAML)
    (tmp_path / "train.py").write_text(ACCELERATE_SCRIPT)
    out = tmp_path / "out"

    def launch(*resume: str) -> None:
        run_cli([sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file",
                 "accelerate.yaml", "--main_process_port", str(free_port()), "train.py", model_dir, str(out), *resume],
                tmp_path)

    launch()
    run = torch.load(out / "run.pt", weights_only=True)

    assert run["processes"] == WORLD and run["partitioned"]
    assert (run["stage"], run["gas"], run["clip"], run["offloaded"]) == (3, GAS, CLIP, True)
    batches = step_batches(TokenDataset(), STEPS, MICRO * GAS * WORLD)
    start = initial_weights(model_dir)
    if variant == "accelerate_config":
        assert run["optimizer"] == "DeepSpeedCPUAdam" and run["bf16"]
        # bf16 as DeepSpeed runs it (masters from the rounded weights); only the sums' order differs.
        expected, expected_losses = reference_training(model_dir, batches, [LR] * STEPS, "AdamW", WEIGHT_DECAY, BETAS,
                                                       CLIP, base_lr=LR, bf16_micro_batch=MICRO)
        start, tolerance, loss_tolerance = bf16_rounded(start), 2e-2, 1e-4
    else:
        assert run["optimizer"] == "MuonWithAuxAdam" and not run["bf16"]
        expected, expected_losses = reference_training(model_dir, batches, warmup_lrs(LR, STEPS, WARMUP), "Muon",
                                                       WEIGHT_DECAY, BETAS, CLIP, base_lr=LR, muon_lr=MUON_LR)
        tolerance, loss_tolerance = 1e-3, 1e-5
    assert run["losses"] == pytest.approx(expected_losses, rel=loss_tolerance)
    assert_changes_match(start, run["params"], expected, tolerance)

    # get_state_dict and save_model: the trained weights whole, in the model's dtype.
    exported = run["exported"]
    assert exported.keys() == run["params"].keys()
    for name, master in run["params"].items():
        assert torch.equal(exported[name], master.to(exported[name].dtype)), name
    saved = read_safetensors(str(out / "exported"))
    assert all(torch.equal(saved[name], value) for name, value in exported.items())
    # load_state then the same steps again, in the trained processes and in a second launch: the uninterrupted
    # run's numbers bit for bit.
    launch(str(out / "state"))
    resumed = torch.load(out / "resumed.pt", weights_only=True)
    for reloaded in ({"resumed_at": run["resumed_at"], "losses": run["reloaded_losses"],
                      "params": run["reloaded_params"]}, resumed):
        assert reloaded["resumed_at"] == SAVE_AT
        assert reloaded["losses"] == run["losses"][SAVE_AT:]
        for name, value in run["params"].items():
            assert torch.equal(reloaded["params"][name], value), name


def test_deepspeed_launcher_trainer_zero3_offload_resume(tmp_path):
    model_dir = save_initial_model(tmp_path)
    (tmp_path / "ds_config_zero3.json").write_text(json.dumps(guide_zero3_offload_config("Muon")))
    (tmp_path / "train.py").write_text(TRAINER_SCRIPT)

    def launch(output_dir: str, *resume: str) -> dict:
        run_cli([sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", str(free_port()), "--num_gpus",
                 str(WORLD), "train.py", "--deepspeed", "ds_config_zero3.json", "--output_dir", output_dir,
                 "--per_device_train_batch_size", str(MICRO), "--gradient_accumulation_steps", str(GAS), "--max_steps",
                 str(STEPS), "--learning_rate", str(LR), "--warmup_steps", str(WARMUP), "--weight_decay",
                 str(WEIGHT_DECAY), "--adam_beta1", str(BETAS[0]), "--adam_beta2", str(BETAS[1]), "--adam_epsilon",
                 str(ADAM_EPS), "--max_grad_norm", str(CLIP), "--logging_steps", "1", "--save_strategy", "steps",
                 "--save_steps", str(SAVE_AT), "--report_to", "none", "--seed", "0", "--train_sampling_strategy",
                 "sequential", "--disable_tqdm", "true", "--accelerator_config", '{"use_configured_state": true}',
                 model_dir, *resume], tmp_path)
        return torch.load(os.path.join(str(tmp_path), output_dir, "run.pt"), weights_only=True)

    whole = launch("run")
    assert whole["processes"] == WORLD and whole["partitioned"]
    assert (whole["stage"], whole["offloaded"], whole["optimizer"]) == (3, True, "MuonWithAuxAdam")
    assert whole["global_steps"] == STEPS
    batches = step_batches(TokenDataset(), STEPS, MICRO * GAS * WORLD)
    expected, expected_losses = reference_training(model_dir, batches, warmup_lrs(LR, STEPS, WARMUP), "Muon",
                                                   WEIGHT_DECAY, BETAS, CLIP, base_lr=LR, muon_lr=MUON_LR)
    assert [whole["losses"][step] for step in range(1, STEPS + 1)] == pytest.approx(expected_losses, rel=1e-5)
    assert_changes_match(initial_weights(model_dir), whole["params"], expected, 1e-3)
    # save_model (stage3_gather_16bit_weights_on_model_save): the trained weights whole (fp32 on CPU).
    saved = read_safetensors(str(tmp_path / "run" / "exported"))
    for name, value in whole["params"].items():
        assert torch.equal(saved[name], value), name

    resumed = launch("resumed", str(tmp_path / "run" / f"checkpoint-{SAVE_AT}"))
    assert resumed["global_steps"] == STEPS
    assert [resumed["losses"][step] for step in range(SAVE_AT + 1, STEPS + 1)] == [
        whole["losses"][step] for step in range(SAVE_AT + 1, STEPS + 1)]
    for name, value in whole["params"].items():
        assert torch.equal(resumed["params"][name], value), name
