"""Base model for DeepSpeed config sections, and config errors whose messages name the key."""

import logging
import math
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator, model_validator

logger = logging.getLogger("DeepSpeed")

AUTO = "auto"


class DeepSpeedConfigError(ValueError):
    """A config value, or a combination of values, is invalid; the message names the key and what was expected."""


class DeepSpeedConfigAssertionError(DeepSpeedConfigError, AssertionError):
    """A config error that upstream DeepSpeed raises as AssertionError (batch sizes, precision modes, names).

    Deriving from both keeps upstream-style `except AssertionError` callers and our `except ValueError` working.
    """


def _identity(value: Any) -> Any:
    return value


class DeprecatedKey(NamedTuple):
    """Where a deprecated key's value goes: the new key and a converter (None from it means "drop the key")."""

    new_key: str
    convert: Callable[[Any], Any] = _identity


def accepted_keys(model_cls: type[BaseModel]) -> list[str]:
    """Every key a section accepts: field names and their aliases, sorted."""
    keys = set(model_cls.model_fields)
    keys.update(field.alias for field in model_cls.model_fields.values() if field.alias)
    return sorted(keys)


def _numeric_kind(annotation: Any) -> type | None:
    """int or float when a field holds a number (optionally None), else None."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    else:
        members = [annotation]
    if len(members) != 1 or not isinstance(members[0], type) or issubclass(members[0], bool):
        return None
    if issubclass(members[0], int):
        return int
    return float if issubclass(members[0], float) else None


class DeepSpeedConfigModel(BaseModel):
    """Base of every config section.

    Unknown keys are rejected with a message naming the key and the section; values equal to "auto" are
    dropped so the field default applies; deprecated keys are mapped to their replacement with upstream's
    warning; numeric fields reject bools, strings and inf/nan. Subclasses set `section` (the dotted path of
    the section in the JSON config, used in messages) and may list `deprecated_keys`.
    """

    model_config = ConfigDict(
        extra="forbid",
        populate_by_name=True,
        use_enum_values=True,
        protected_namespaces=(),
        arbitrary_types_allowed=True,
    )

    section: ClassVar[str] = ""
    deprecated_keys: ClassVar[dict[str, DeprecatedKey]] = {}

    @classmethod
    def key_path(cls, key: str) -> str:
        """Dotted path of `key` in the JSON config, e.g. "zero_optimization.reduce_bucket_size"."""
        return f"{cls.section}.{key}" if cls.section else key

    @model_validator(mode="before")
    @classmethod
    def _normalise_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = {key: value for key, value in data.items() if not (isinstance(value, str) and value == AUTO)}
        data = cls._upgrade_legacy_keys(data)
        cls._check_keys(data)
        return data

    @classmethod
    def _upgrade_legacy_keys(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Move deprecated keys to their replacements; subclasses extend this for structural changes."""
        for old_key, (new_key, convert) in cls.deprecated_keys.items():
            if old_key not in data:
                continue
            logger.warning(f"Config parameter {old_key} is deprecated use {new_key} instead")
            value = data.pop(old_key)
            new_field = cls.model_fields[new_key]
            if new_key in data or (new_field.alias and new_field.alias in data):
                raise ValueError(
                    f"{cls.key_path(old_key)} is deprecated and conflicts with "
                    f"{cls.key_path(new_key)}; keep only {new_key}"
                )
            converted = convert(value)
            if converted is not None:
                data[new_key] = converted
        return data

    @classmethod
    def _check_keys(cls, data: dict[str, Any]) -> None:
        """Reject unknown keys, and a field given under both its name and its alias."""
        known = accepted_keys(cls)
        unknown = sorted(str(key) for key in data if key not in known)
        if unknown:
            quoted = ", ".join(f"'{key}'" for key in unknown)
            noun = "key" if len(unknown) == 1 else "keys"
            raise ValueError(f"Unknown {noun} {quoted} in section '{cls.section}'; expected one of {known}")
        for name, field in cls.model_fields.items():
            if field.alias and field.alias != name and name in data and field.alias in data:
                raise ValueError(f"{cls.key_path(name)} is given twice, also as its alias {field.alias}; keep one")

    @field_validator("*", mode="before")
    @classmethod
    def _check_number(cls, value: Any, info: ValidationInfo) -> Any:
        kind = _numeric_kind(cls.model_fields[info.field_name].annotation)
        if kind is None or value is None:
            return value
        path = cls.key_path(info.field_name)
        if isinstance(value, bool):
            raise ValueError(f"{path} must be a number, not bool (got {value!r})")
        if not isinstance(value, (int, float)):
            raise ValueError(f"{path} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{path} must be a finite number (not inf/-inf/nan), got {value!r}")
        if kind is int and value != int(value):
            raise ValueError(f"{path} must be an integer, got {value!r}")
        if kind is int and abs(value) >= 2**63:
            # Checked here: pydantic reports an integral float this large (1e30) as a string it cannot parse.
            raise ValueError(f"{path} must be an integer of magnitude below 2**63, got {value!r}")
        return value


_BOUND_ERRORS = {
    "greater_than": (">", "gt"),
    "greater_than_equal": (">=", "ge"),
    "less_than": ("<", "lt"),
    "less_than_equal": ("<=", "le"),
}


def describe_validation_error(error: ValidationError, section: str = "") -> str:
    """One line per problem, each naming the dotted key path and what was expected.

    Messages written by our validators already name their key and are kept verbatim; pydantic's own
    messages get the key path in front. `section` is the path of the validated model in the JSON config
    ("" for the whole config), since pydantic's locations are relative to the model.
    """
    lines = []
    for item in error.errors(include_url=False):
        loc = ([section] if section else []) + [str(part) for part in item["loc"]]
        path = ".".join(loc)
        ctx = item.get("ctx") or {}
        if "error" in ctx:
            lines.append(str(ctx["error"]))
        elif item["type"] in _BOUND_ERRORS:
            operator, bound_key = _BOUND_ERRORS[item["type"]]
            lines.append(f"{path} must be {operator} {ctx[bound_key]}, got {item['input']!r}")
        elif item["type"] == "missing":
            lines.append(f"Missing required key '{loc[-1]}' in section '{'.'.join(loc[:-1])}'")
        else:
            lines.append(f"{path}: {item['msg']}, got {item['input']!r}")
    return "\n".join(lines)


def validate_config(model_cls: type[BaseModel], data: Any) -> BaseModel:
    """`model_cls.model_validate(data)`, with errors raised as DeepSpeedConfigError naming the keys.

    Raises:
        DeepSpeedConfigError: any key is unknown, missing or invalid.
    """
    try:
        return model_cls.model_validate(data)
    except ValidationError as err:
        section = getattr(model_cls, "section", "")
        raise DeepSpeedConfigError(describe_validation_error(err, section)) from err
