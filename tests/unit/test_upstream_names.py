"""Upstream DeepSpeed 0.19.8's names in the modules scripts import: each is provided, or imports and fails on first
use saying that this fork does not provide it and what to use instead. The lists are docs/upstream-differences.md's."""

import argparse
import importlib
import logging
import re
from pathlib import Path

import pytest
import torch

import deepspeed
from deepspeed.not_provided import NOT_PROVIDED, NotProvidedAttributeError, NotProvidedError, is_stand_in

DOCS = Path(__file__).resolve().parents[2] / "docs" / "upstream-differences.md"
SECTION = "## Upstream names: what is provided"


def documented_names() -> dict[str, tuple[list[str], list[str]]]:
    """module -> (provided names, not provided names), as docs/upstream-differences.md lists them."""
    text = DOCS.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    modules = {}
    for block in re.split(r"^### ", text, flags=re.M)[1:]:
        module = re.match(r"`([\w.]+)`", block).group(1)
        provided_line = re.search(r"^Provided: (.*)$", block, re.M).group(1)
        provided = re.findall(r"`([\w.]+)`", provided_line)
        rows = [line for line in block.splitlines() if line.startswith("| `")]
        missing = [name for row in rows for name in re.findall(r"`(\w+)`", row.split(" | ")[0])]
        modules[module] = (provided, missing)
    return modules


DOCUMENTED = documented_names()
PROVIDED = [pytest.param(m, n, id=f"{m}.{n}") for m, (names, _) in DOCUMENTED.items() for n in names]
MISSING = [pytest.param(m, n, id=f"{m}.{n}") for m, (_, names) in DOCUMENTED.items() for n in names]


def test_the_docs_list_the_swept_modules_and_the_table():
    expected = {"deepspeed", "deepspeed.comm", "deepspeed.accelerator", "deepspeed.utils", "deepspeed.runtime.zero",
                "deepspeed.checkpoint", "deepspeed.ops", "deepspeed.ops.adam", "deepspeed.ops.op_builder"}
    assert expected <= set(DOCUMENTED)
    assert set(NOT_PROVIDED) <= set(DOCUMENTED)
    for module, (provided, missing) in DOCUMENTED.items():
        assert sorted(missing) == sorted(NOT_PROVIDED.get(module, {})), module
        assert not set(provided) & set(missing), module


@pytest.mark.parametrize("module, name", PROVIDED)
def test_provided(module, name):
    assert not is_stand_in(getattr(importlib.import_module(module), name))


@pytest.mark.parametrize("module, name", MISSING)
def test_not_provided_imports_and_fails_on_use(module, name):
    namespace = {}
    exec(f"from {module} import {name}", namespace)
    stand_in = namespace[name]
    assert stand_in is getattr(importlib.import_module(module), name)
    expected = f"{module}.{name} is not provided by this fork (upstream DeepSpeed has it): "
    with pytest.raises(NotProvidedError) as info:
        if NOT_PROVIDED[module][name].is_value:
            bool(stand_in)
        else:
            stand_in()
    assert str(info.value) == expected + NOT_PROVIDED[module][name].advice
    with pytest.raises(NotProvidedAttributeError, match=re.escape(expected)):
        stand_in.anything  # noqa: B018 -- the read is the use under test
    assert not hasattr(stand_in, "anything")
    assert name in repr(stand_in)


def test_a_value_fails_however_it_is_used():
    from deepspeed.checkpoint import OPTIMIZER_STATE_DICT

    for use in (lambda v: {"a": 1}[v], lambda v: f"{v}", lambda v: v == "optimizer_state_dict", lambda v: v + "x",
                lambda v: str(v), lambda v: len(v)):
        with pytest.raises(NotProvidedError, match="deepspeed.checkpoint.OPTIMIZER_STATE_DICT is not provided"):
            use(OPTIMIZER_STATE_DICT)


def test_a_stand_in_class_stays_a_class():
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    assert isinstance(FusedAdam, type) and not isinstance(torch.optim.AdamW([torch.zeros(1)]), FusedAdam)
    assert FusedAdam is not DeepSpeedCPUAdam

    class Subclass(FusedAdam):
        pass

    with pytest.raises(NotProvidedError, match="deepspeed.ops.adam.FusedAdam is not provided"):
        Subclass([torch.zeros(1)])


def test_unknown_names_are_still_attribute_errors():
    import deepspeed.ops.adam

    for module, name in ((deepspeed, "no_such_name"), (deepspeed.ops.adam, "NoSuchAdam"), (deepspeed.comm, "nope")):
        with pytest.raises(AttributeError, match=f"has no attribute '{name}'") as info:
            getattr(module, name)
        assert not isinstance(info.value, NotProvidedError)
    with pytest.raises(ImportError):
        exec("from deepspeed.ops.lamb import NoSuchLamb", {})


def test_the_accelerator_finds_the_built_op_builder_only():
    accelerator = deepspeed.get_accelerator()
    assert accelerator.get_op_builder("CPUAdamBuilder").NAME == "cpu_adam"
    assert accelerator.create_op_builder("CPUAdamBuilder").NAME == "cpu_adam"
    assert accelerator.get_op_builder("FusedAdamBuilder") is None
    assert accelerator.create_op_builder("FusedAdamBuilder") is None


def test_add_config_arguments(tmp_path):
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert (args.deepspeed, args.deepspeed_config, args.deepscale, args.deepscale_config) == (
        True, "ds.json", False, None)
    assert deepspeed.public_api._resolve_config(args, None) == "ds.json"
    legacy = parser.parse_args(["--deepscale_config", "old.json"])
    assert deepspeed.public_api._resolve_config(legacy, None) == "old.json"


def test_small_provided_helpers():
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.utils import RepeatingLoader

    assert deepspeed.zero is importlib.import_module("deepspeed.runtime.zero")
    assert deepspeed.MUON_OPTIMIZER == "muon" and deepspeed.HAS_TRITON is False
    assert issubclass(DeepSpeedZeroOptimizer, deepspeed.DeepSpeedOptimizer)
    assert list(zip(range(7), RepeatingLoader([1, 2, 3]))) == [(0, 1), (1, 2), (2, 3), (3, 1), (4, 2), (5, 3), (6, 1)]
    layer = torch.nn.Linear(2, 2)
    with deepspeed.zero.GatheredParameters(layer.weight, modifier_rank=0):
        layer.weight.data.zero_()
    assert layer.weight.abs().sum() == 0
    with deepspeed.zero.Init(enabled=False):
        torch.nn.Linear(2, 2)
    with pytest.raises(NotProvidedError, match=r"deepspeed.zero.Init\(remote_device=...\) is not provided"):
        deepspeed.zero.Init(config_dict_or_path={}, remote_device="nvme")


def test_set_optimizer_flags_tags_for_muon_only():
    model = torch.nn.Sequential(torch.nn.Embedding(4, 3), torch.nn.Linear(3, 3))
    deepspeed.set_optimizer_flags(deepspeed.DeepSpeedConfig({"train_batch_size": 1, "optimizer": {"type": "AdamW"}}),
                                  model)
    assert not any(hasattr(p, "use_muon") for p in model.parameters())
    deepspeed.set_optimizer_flags(deepspeed.DeepSpeedConfig({"train_batch_size": 1, "optimizer": {"type": "Muon"}}),
                                  model)
    # The default split gives the embedding to Adam; upstream's name rule ("0.weight" holds no "embed") to Muon.
    assert [p.use_muon for p in model.parameters()] == [False, True, False]
    upstream = torch.nn.Sequential(torch.nn.Embedding(4, 3), torch.nn.Linear(3, 3))
    deepspeed.set_optimizer_flags(deepspeed.DeepSpeedConfig(
        {"train_batch_size": 1, "optimizer": {"type": "Muon", "params": {"param_split": "upstream"}}}), upstream)
    assert [p.use_muon for p in upstream.parameters()] == [True, True, False]


def test_logging_helpers():
    from deepspeed.utils import log_dist_once, logger, set_log_level_from_string

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    level = logger.level
    logger.addHandler(handler)
    try:
        set_log_level_from_string("INFO")
        assert logger.level == logging.INFO and handler.level == logging.INFO
        for _ in range(3):
            log_dist_once("said once", ranks=[0])
        assert [r.getMessage() for r in records].count("[Rank 0] said once") == 1
        with pytest.raises(ValueError, match="log level must be one of"):
            set_log_level_from_string("loud")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
