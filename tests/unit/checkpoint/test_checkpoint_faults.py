"""Checkpoint layout, safe loading and faults: what is written, what is refused, and that a failure on one
rank fails every rank (no hang) and leaves the previous checkpoint and the engine as they were."""

import glob
import logging
import os
from unittest import mock

import pytest
import torch

import deepspeed.comm as dist
from deepspeed.checkpoint.engine_io import CheckpointError
from unit.checkpoint.resume_harness import (assert_identical, batches_for, checkpoint_config, full_snapshot,
                                            new_engine, train)
from unit.common import DistributedTest

MODEL_FILE = "mp_rank_00_model_states.pt"


def _optim_file(rank, bf16=False):
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def _trained(config, steps=2, seed=0, **model):
    engine = new_engine(config, seed=seed, **model)
    dtype = "fp16" if config.get("fp16") else "bf16" if config.get("bf16") else "fp32"
    train(engine, batches_for(engine, steps), dtype)
    return engine


def _read_latest(directory):
    with open(os.path.join(str(directory), "latest")) as f:
        return f.read()


def _temporary_files(directory):
    return glob.glob(os.path.join(str(directory), "**", "*.tmp*"), recursive=True)


def _on_rank0(action):
    """Let rank 0 touch the shared files, then let everybody see the result."""
    if dist.get_rank() == 0:
        action()
    dist.barrier()


def _raises_everywhere(call, *fragments):
    """`call` raises on this rank, and the message names every fragment (a file, a mismatch)."""
    with pytest.raises(Exception) as info:
        call()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {type(info.value).__name__}: {message}"
    return info.value


class TestLayout(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("dtype", ["fp16", "bf16"])
    @pytest.mark.parametrize("stage", [0, 2])
    def test_files_latest_and_weights_only(self, class_tmpdir, stage, dtype):
        directory = os.path.join(str(class_tmpdir), f"layout-{stage}-{dtype}")
        engine = _trained(checkpoint_config(stage, dtype, "muon"))
        assert engine.save_checkpoint(directory) is True
        tag = f"global_step{engine.global_steps}"
        assert _read_latest(directory) == tag
        bf16 = dtype == "bf16"
        expected = sorted([MODEL_FILE, _optim_file(0, bf16), _optim_file(1, bf16)])
        assert sorted(os.listdir(os.path.join(directory, tag))) == expected
        assert os.access(os.path.join(directory, "zero_to_fp32.py"), os.X_OK)
        assert _temporary_files(directory) == []
        for name in expected:
            state = torch.load(os.path.join(directory, tag, name), map_location="cpu", weights_only=True)
            assert isinstance(state, dict)
        model_state = torch.load(os.path.join(directory, tag, MODEL_FILE), map_location="cpu", weights_only=True)
        assert model_state["global_steps"] == 2 and model_state["dp_world_size"] == 2
        assert model_state["zero_stage"] == stage and model_state["precision"] == dtype
        assert list(model_state["module"]) == list(engine.module.state_dict())
        # Another save under an explicit tag, without moving `latest`.
        assert engine.save_checkpoint(directory, tag=7, save_latest=False) is True
        assert os.path.isfile(os.path.join(directory, "7", MODEL_FILE))
        assert _read_latest(directory) == tag

    def test_client_state_round_trip(self, class_tmpdir):
        directory = os.path.join(str(class_tmpdir), "client")
        engine = _trained(checkpoint_config(1, "fp32"))
        client = {"epoch": 3, "note": "warm", "ratio": 0.5, "tokens": torch.arange(4), "nested": {"a": [1, 2.5, None]},
                  "dtype": torch.bfloat16}
        engine.save_checkpoint(directory, tag="c", client_state=client)
        fresh = new_engine(checkpoint_config(1, "fp32"), seed=1)
        load_path, client_state = fresh.load_checkpoint(directory, tag="c")
        assert load_path == os.path.join(directory, "c", MODEL_FILE)
        assert_identical(client_state, client, "client_state")
        # A reserved key or an object that weights_only loading could not read fails on every rank before any
        # file is written, and `latest` stays.
        _raises_everywhere(lambda: engine.save_checkpoint(directory, tag="d", client_state={"global_steps": 1}),
                           "global_steps")
        _raises_everywhere(lambda: engine.save_checkpoint(directory, tag="d", client_state={"fn": object()}),
                           "client_state['fn']", "object")
        assert not os.path.exists(os.path.join(directory, "d", MODEL_FILE))
        assert _read_latest(directory) == "c"

    def test_no_latest_returns_none_with_upstream_warning(self, class_tmpdir):
        directory = os.path.join(str(class_tmpdir), f"empty-{dist.get_rank()}")
        os.makedirs(directory)
        engine = new_engine(checkpoint_config(1, "fp32"))
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logger = logging.getLogger("DeepSpeed")
        logger.addHandler(handler)
        try:
            assert engine.load_checkpoint(directory) == (None, None)
        finally:
            logger.removeHandler(handler)
        assert any(f"Unable to find latest file at {os.path.join(directory, 'latest')}, if trying to load latest "
                   "checkpoint please ensure this file exists or pass an explicit checkpoint tag when loading a "
                   "checkpoint." in record.getMessage() for record in records)
        assert engine.global_steps == 0
        config = checkpoint_config(1, "fp32")
        config["checkpoint"] = {"load_universal": True}
        with pytest.raises(ValueError, match="Invalid for universal checkpoint: .*latest_universal does not exist"):
            new_engine(config).load_checkpoint(directory)


class TestInterruptedSave(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("failing_rank, failing_call", [(1, 1), (0, 2)], ids=["rank1-optim", "rank0-model"])
    def test_previous_latest_survives(self, class_tmpdir, failing_rank, failing_call):
        directory = os.path.join(str(class_tmpdir), f"interrupted-{failing_rank}")
        config = checkpoint_config(2, "bf16", "muon")
        engine = _trained(config)
        engine.save_checkpoint(directory, tag="good")
        at_good = full_snapshot(engine)
        train(engine, batches_for(engine, 1, seed=7), "bf16")

        real_save = torch.save
        calls = []

        def failing_save(obj, f, *args, **kwargs):
            calls.append(f)
            if dist.get_rank() == failing_rank and len(calls) == failing_call:
                f.write(b"PK partial")  # a half-written file, then the failure
                raise OSError("disk full (injected)")
            return real_save(obj, f, *args, **kwargs)

        for tag in ("bad", "good"):  # a new tag, then overwriting the committed one
            calls.clear()
            with mock.patch.object(torch, "save", failing_save):
                error = _raises_everywhere(lambda tag=tag: engine.save_checkpoint(directory, tag=tag),
                                           "disk full (injected)")
            if dist.get_rank() != failing_rank:
                assert isinstance(error, RuntimeError) and f"rank {failing_rank}" in str(error)
            dist.barrier()  # every rank has cleaned up its temporary files
            assert _read_latest(directory) == "good"
            assert _temporary_files(directory) == []
        assert not os.path.exists(os.path.join(directory, "bad", MODEL_FILE))
        assert not os.path.exists(os.path.join(directory, "bad", _optim_file(0, True)))

        fresh = new_engine(config, seed=1)
        fresh.load_checkpoint(directory)
        assert_identical(full_snapshot(fresh), at_good, "loaded after the failed saves")


def _logged(call):
    """`call()`'s result and the DeepSpeed logger's records at INFO and above while it ran."""
    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("DeepSpeed")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        return call(), records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class TestMismatchedTags(DistributedTest):
    """Ranks that pass different tags: Fail refuses before anything is written; Warn and Ignore save one complete
    checkpoint under rank 0's tag (never a file error on one rank, never a partial checkpoint)."""

    world_size = 2

    @pytest.mark.parametrize("mode", ["Warn", "Ignore", "Fail"])
    def test_tag_validation(self, class_tmpdir, mode):
        directory = os.path.join(str(class_tmpdir), f"tags-{mode}")
        config = checkpoint_config(1, "fp32")
        config["checkpoint"] = {"tag_validation": mode}
        engine = _trained(config)
        engine.save_checkpoint(directory, tag="before")
        saved = full_snapshot(engine)
        train(engine, batches_for(engine, 1, seed=7), "fp32")
        tags = ["step-rank0", "step-rank1"]
        mine = tags[dist.get_rank()]
        upstream = f"[rank={dist.get_rank()}] The checkpoint tag name '{mine}' is not consistent across all ranks."
        if mode == "Fail":
            error = _raises_everywhere(lambda: engine.save_checkpoint(directory, tag=mine), upstream,
                                       "rank 0: 'step-rank0', rank 1: 'step-rank1'", "nothing was saved")
            assert isinstance(error, AssertionError)
            dist.barrier()
            assert sorted(os.listdir(directory)) == ["before", "latest", "zero_to_fp32.py"]
            assert _read_latest(directory) == "before"
            fresh = new_engine(config, seed=1)
            fresh.load_checkpoint(directory)
            assert_identical(full_snapshot(fresh), saved, "the previous checkpoint, after the refused save")
            return
        result, records = _logged(lambda: engine.save_checkpoint(directory, tag=mine))
        assert result is True
        warnings = [r.getMessage() for r in records if r.levelno >= logging.WARNING and upstream in r.getMessage()]
        if mode == "Warn":
            assert len(warnings) == 1, warnings
            assert "rank 0: 'step-rank0', rank 1: 'step-rank1'" in warnings[0]
            assert "every rank saves under rank 0's tag 'step-rank0'" in warnings[0]
        else:
            assert warnings == []
        dist.barrier()
        assert sorted(os.listdir(directory)) == ["before", "latest", "step-rank0", "zero_to_fp32.py"]
        assert sorted(os.listdir(os.path.join(directory, "step-rank0"))) == sorted(
            [MODEL_FILE, _optim_file(0), _optim_file(1)])
        assert _read_latest(directory) == "step-rank0" and _temporary_files(directory) == []
        at_save = full_snapshot(engine)
        fresh = new_engine(config, seed=1)
        fresh.load_checkpoint(directory)
        assert_identical(full_snapshot(fresh), at_save, "loaded from rank 0's tag")


class TestRefusedLoads(DistributedTest):
    world_size = 2

    def test_corrupted_truncated_and_missing_files(self, class_tmpdir):
        directory = os.path.join(str(class_tmpdir), "damaged")
        config = checkpoint_config(1, "fp16")
        engine = _trained(config)
        engine.save_checkpoint(directory, tag="t")
        tag_dir = os.path.join(directory, "t")
        fresh = new_engine(config, seed=1)
        before = full_snapshot(fresh)

        def damage(name, action):
            path = os.path.join(tag_dir, name)
            backup = path + ".orig"
            _on_rank0(lambda: os.replace(path, backup) if action == "delete" else _copy_then(path, backup, action))
            return backup

        def _copy_then(path, backup, action):
            with open(path, "rb") as f:
                data = f.read()
            os.replace(path, backup)
            with open(path, "wb") as f:
                f.write(data[:len(data) // 2] if action == "truncate" else b"not a checkpoint" * 64)

        for name, action, fragments in [
            (_optim_file(1), "corrupt", [_optim_file(1), "cannot be loaded"]),
            (MODEL_FILE, "truncate", [MODEL_FILE, "cannot be loaded"]),
            (_optim_file(1), "delete", ["incomplete", _optim_file(1)]),
        ]:
            backup = damage(name, action)
            # Only rank 1 reads a damaged optim file of rank 1; every rank raises a CheckpointError naming it.
            error = _raises_everywhere(lambda: fresh.load_checkpoint(directory, tag="t"), *fragments)
            assert isinstance(error, CheckpointError)
            # Refused before anything changed, on every rank.
            assert_identical(full_snapshot(fresh), before, f"engine after a refused load ({action} {name})")
            _on_rank0(lambda backup=backup, name=name: os.replace(backup, os.path.join(tag_dir, name)))
        # Even a module-only load refuses a tag whose files are not all there.
        damage(_optim_file(0), "delete")
        _raises_everywhere(lambda: fresh.load_checkpoint(directory, tag="t", load_module_only=True), _optim_file(0))
        _raises_everywhere(lambda: fresh.load_checkpoint(directory, tag="missing"),
                           os.path.join(directory, "missing", MODEL_FILE), "does not exist")

    def test_other_stage_precision_model_or_optimizer(self, class_tmpdir):
        directory = os.path.join(str(class_tmpdir), "mismatch")
        trained = _trained(checkpoint_config(1, "bf16"))
        trained.save_checkpoint(directory, tag="t")
        saved = full_snapshot(trained)
        model_path = os.path.join(directory, "t", MODEL_FILE)
        optim_path = os.path.join(directory, "t", _optim_file(dist.get_rank(), True))
        cases = [
            (checkpoint_config(1, "fp16"), {}, [model_path, "saved in bf16", "trains in fp16"]),
            (checkpoint_config(1, "bf16"), {"hidden": 8}, [model_path, "shape mismatch", "linears.0.weight"]),
            (checkpoint_config(1, "bf16"), {"nlayers": 3}, [model_path, "missing keys", "linears.2.weight"]),
            (checkpoint_config(1, "bf16", "muon"), {}, [optim_path, "differs"]),
        ]
        for config, model, fragments in cases:
            engine = new_engine(config, seed=1, **model)
            before = full_snapshot(engine)
            error = _raises_everywhere(lambda engine=engine: engine.load_checkpoint(directory), *fragments)
            assert isinstance(error, CheckpointError)
            assert_identical(full_snapshot(engine), before, f"engine after a refused load {fragments}")
        # Another stage at the same world size is regrouped (test_resume_other_world_size.py covers the rest).
        for stage in (2, 0):
            engine = new_engine(checkpoint_config(stage, "bf16"), seed=1)
            engine.load_checkpoint(directory)
            got = full_snapshot(engine)
            for key in ("params", "masters", "states", "counters"):
                assert_identical(got[key], saved[key], f"stage 1 -> {stage}: {key}")


    def test_muon_options_against_the_checkpoint(self, class_tmpdir):
        """NorMuon's switch and the momentum dtype are part of what a checkpoint's Muon state means: a resume that
        changes them is refused by name, both ways, with the engine left as it was (torch's load would carry the
        saved options over silently)."""
        for saved, loading, key in (("muon-options", "muon", "normuon"), ("muon", "muon-options", "normuon"),
                                    ("bf16-momentum", "muon", "momentum_dtype")):
            directory = os.path.join(str(class_tmpdir), f"{saved}-to-{loading}")
            _trained(checkpoint_config(1, "bf16", saved)).save_checkpoint(directory, tag="t")
            optim_path = os.path.join(directory, "t", _optim_file(dist.get_rank(), True))
            engine = new_engine(checkpoint_config(1, "bf16", loading), seed=1)
            before = full_snapshot(engine)
            error = _raises_everywhere(lambda engine=engine, directory=directory: engine.load_checkpoint(directory),
                                       optim_path, f"optimizer.params.{key}", "differs")
            assert isinstance(error, CheckpointError)
            assert_identical(full_snapshot(engine), before, f"engine after a refused load ({saved} -> {loading})")

    def test_a_momentum_in_another_dtype_than_its_group_is_refused(self, class_tmpdir):
        """A file whose Muon momentum is not in the dtype its saved group keeps it in (momentum_dtype) is refused
        naming the file; the optimizer never converts a momentum silently."""
        directory = os.path.join(str(class_tmpdir), "momentum-dtype")
        _trained(checkpoint_config(1, "bf16", "bf16-momentum")).save_checkpoint(directory, tag="t")
        optim_path = os.path.join(directory, "t", _optim_file(dist.get_rank(), True))
        saved = torch.load(optim_path, map_location="cpu", weights_only=True)
        states = saved["optimizer_state_dict"]["base_optimizer_state"]["state"]
        momenta = [state for state in states.values() if "momentum_buffer" in state]
        assert momenta and all(state["momentum_buffer"].dtype == torch.bfloat16 for state in momenta)
        for state in momenta:
            state["momentum_buffer"] = state["momentum_buffer"].float()
        torch.save(saved, optim_path)
        dist.barrier()
        engine = new_engine(checkpoint_config(1, "bf16", "bf16-momentum"), seed=1)
        before = full_snapshot(engine)
        error = _raises_everywhere(lambda: engine.load_checkpoint(directory), optim_path,
                                   "dtype of optimizer state 'momentum_buffer'", "torch.float32", "torch.bfloat16")
        assert isinstance(error, CheckpointError)
        assert_identical(full_snapshot(engine), before, "engine after a refused load (momentum dtype)")


class TestPartialLoads(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("stage", [1, 2])
    def test_module_only_and_without_optimizer_states(self, class_tmpdir, stage):
        directory = os.path.join(str(class_tmpdir), f"partial-{stage}")
        config = checkpoint_config(stage, "fp16")
        engine = _trained(config, steps=3)
        engine.save_checkpoint(directory, client_state={"epoch": 1})
        saved = full_snapshot(engine)

        # load_module_only: the weights (masters rebuilt from them); counters, scheduler, scaler untouched.
        fresh = new_engine(config, seed=1)
        untouched = full_snapshot(fresh)["counters"]
        load_path, client_state = fresh.load_checkpoint(directory, load_module_only=True)
        assert load_path.endswith(os.path.join("global_step3", MODEL_FILE)) and client_state == {"epoch": 1}
        got = full_snapshot(fresh)
        assert_identical(got["params"], saved["params"], "module-only params")
        assert_identical(got["masters"], [p.float() for p in saved["params"]], "masters rebuilt from the weights")
        assert_identical(got["counters"], untouched, "module-only counters")
        assert got["states"] is None and got["local_states"] == [{} for _ in got["local_states"]]
        train(fresh, batches_for(fresh, 1), "fp16")
        assert fresh.global_steps == 1

        # load_optimizer_states=False: weights and counters and scheduler; no optimizer state, fresh loss scaler.
        fresh = new_engine(config, seed=1)
        scaler = fresh.optimizer.loss_scaler.state_dict()
        fresh.load_checkpoint(directory, load_optimizer_states=False)
        got = full_snapshot(fresh)
        assert_identical(got["params"], saved["params"], "params")
        assert_identical(got["masters"], [p.float() for p in saved["params"]], "masters rebuilt from the weights")
        for key in ("global_steps", "global_samples", "skipped_steps", "micro_steps", "lr_scheduler"):
            assert got["counters"][key] == saved["counters"][key], key
        assert got["counters"]["loss_scaler"] == scaler
        assert got["states"] is None and got["local_states"] == [{} for _ in got["local_states"]]
        train(fresh, batches_for(fresh, 1), "fp16")

        # zero_optimization.load_from_fp32_weights=false: optimizer state restored, masters from the weights.
        config["zero_optimization"]["load_from_fp32_weights"] = False
        fresh = new_engine(config, seed=1)
        fresh.load_checkpoint(directory)
        got = full_snapshot(fresh)
        assert_identical(got["masters"], [p.float() for p in saved["params"]], "masters from the weights")
        assert_identical(got["states"], saved["states"], "optimizer states")
        assert_identical(got["counters"], saved["counters"], "counters")


def test_checkpoint_error_is_a_value_error():
    assert issubclass(CheckpointError, ValueError)
