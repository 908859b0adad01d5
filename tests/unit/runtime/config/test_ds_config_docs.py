"""Every ```json example in docs/*.md is a valid config, and docs/config-json.md covers every key."""

import json
import pathlib
import re

import pydantic
import pytest

from deepspeed.runtime.config import DeepSpeedTopLevelConfig

DOCS = pathlib.Path(__file__).resolve().parents[4] / "docs"
JSON_BLOCK = re.compile(r"```json\n(.*?)```", re.DOTALL)


def json_examples():
    examples = []
    for path in sorted(DOCS.glob("*.md")):
        for index, block in enumerate(JSON_BLOCK.findall(path.read_text())):
            examples.append(pytest.param(block, id=f"{path.name}#{index}"))
    return examples


def test_config_reference_has_examples():
    assert len([p for p in json_examples() if "config-json.md" in p.id]) >= 4


@pytest.mark.parametrize("block", json_examples())
def test_doc_example_parses(make_config, block):
    config = make_config(json.loads(block))
    assert config.train_batch_size == config.train_micro_batch_size_per_gpu * config.gradient_accumulation_steps


def section_models(model_cls, prefix=""):
    yield prefix, model_cls
    for name, field in model_cls.model_fields.items():
        for arg in [field.annotation, *getattr(field.annotation, "__args__", ())]:
            if isinstance(arg, type) and issubclass(arg, pydantic.BaseModel):
                yield from section_models(arg, f"{prefix}{name}.")


def test_reference_lists_every_key():
    text = (DOCS / "config-json.md").read_text()
    missing = [
        f"{prefix}{name}"
        for prefix, model_cls in section_models(DeepSpeedTopLevelConfig)
        for name in model_cls.model_fields
        if f"`{name}`" not in text
    ]
    assert not missing, f"docs/config-json.md does not document {missing}"
