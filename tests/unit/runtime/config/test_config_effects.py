"""Upstream config keys this fork does not act on are never ignored silently (runtime/config_effects.py): set to a
value other than the default, one that would change what training computes is refused naming the key, the value
and the default; one that only tunes upstream's scheduling or logging is warned about. Left at the default, or
written out at the default, neither says anything. docs/config-json.md marks each row alike."""

import pathlib

import pydantic
import pytest

from deepspeed.runtime.config import DeepSpeedTopLevelConfig
from deepspeed.runtime.config_effects import NO_EFFECT, REFUSED, SECTIONS_REFUSED_WHEN_ON, SECTIONS_WITHOUT_EFFECT
from deepspeed.runtime.config_utils import DeepSpeedConfigError

DOCS = pathlib.Path(__file__).resolve().parents[4] / "docs" / "config-json.md"
BASE = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}


def config_keys(model_cls=DeepSpeedTopLevelConfig, prefix=""):
    """Every key path of the config as written in JSON (a field's alias where it has one) -> its field."""
    keys = {}
    for name, field in model_cls.model_fields.items():
        key = f"{prefix}{field.alias or name}"
        keys[key] = field
        for arg in [field.annotation, *getattr(field.annotation, "__args__", ())]:
            if isinstance(arg, type) and issubclass(arg, pydantic.BaseModel):
                keys.update(config_keys(arg, key + "."))
    return keys


def other_value(field):
    """A valid value other than the field's default."""
    default = field.get_default(call_default_factory=True)
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default // 2 if default > 1 else 0.5
    return "fp16"  # data_types.buffer_dtype: null by default


def with_key(key, value):
    config = {k: (dict(v) if isinstance(v, dict) else v) for k, v in BASE.items()}
    section = config
    *path, name = key.split(".")
    for part in path:
        section = section.setdefault(part, {})
    if path == ["zero_optimization", "offload_optimizer"]:
        section["device"] = "cpu"
    if path == ["optimizer"]:
        section["type"] = "AdamW"
    section[name] = value
    return config


def test_every_listed_key_is_a_config_key():
    keys = config_keys()
    unknown = sorted(key for key in (*REFUSED, *NO_EFFECT) if key not in keys)
    assert not unknown, f"config_effects names keys the config does not have: {unknown}"
    assert not set(REFUSED) & set(NO_EFFECT)


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_a_refused_key_names_itself_its_value_and_its_default(make_config, key):
    field = config_keys()[key]
    value = other_value(field)
    config = with_key(key, value)
    if key == "bf16.bf16_optimizer_states":  # upstream requires the bf16 masters with it
        config["bf16"]["bf16_master_weights_and_grads"] = True
    with pytest.raises(DeepSpeedConfigError) as info:
        make_config(config)
    message = str(info.value)
    assert f"{key} = {value!r} is not supported by this fork ({REFUSED[key]})" in message
    assert f"set it to {field.get_default(call_default_factory=True)!r}" in message


@pytest.mark.parametrize("key", sorted(NO_EFFECT))
def test_a_key_without_effect_is_warned(make_config, ds_log, key):
    value = other_value(config_keys()[key])
    make_config(with_key(key, value))
    warnings = [r.getMessage() for r in ds_log.records if r.levelname == "WARNING"]
    assert f"Config key {key} = {value!r} has no effect in this fork: {NO_EFFECT[key]}" in warnings


@pytest.mark.parametrize("key", sorted((*REFUSED, *NO_EFFECT)))
def test_the_default_written_out_says_nothing(make_config, ds_log, key):
    make_config(with_key(key, config_keys()[key].get_default(call_default_factory=True)))
    assert not [r for r in ds_log.records if r.levelname == "WARNING" and key in r.getMessage()]


@pytest.mark.parametrize("key", sorted((*REFUSED, *NO_EFFECT)))
def test_the_reference_row_says_so(key):
    name = key.split(".")[-1]
    pattern = f"(alias `{name}`)" if name.startswith("stage3_") else f"| `{name}` |"
    rows = [line for line in DOCS.read_text().splitlines() if line.startswith("|") and pattern in line]
    marker = "**Refused here**" if key in REFUSED else "**No effect here**"
    assert len(rows) == 1 and marker in rows[0], f"docs/config-json.md row of {key}: {rows}"


@pytest.mark.parametrize("key", [*SECTIONS_REFUSED_WHEN_ON, *SECTIONS_WITHOUT_EFFECT])
def test_every_unimplemented_section_is_listed_with_what_happens(key):
    section = DOCS.read_text().split("## Accepted but not implemented")[1].split("\n## ")[0]
    reason = {**SECTIONS_REFUSED_WHEN_ON, **SECTIONS_WITHOUT_EFFECT}[key]
    assert f"| `{key}` | {reason} |" in section
