"""Which Muon matrices are orthogonalised per attention head, and in how many heads.

A q, k or v projection's output rows are blocked by heads: head h reads only its own block of rows. Orthogonalised
as one matrix, the heads share one set of singular directions, so each head's update depends on the other heads'
gradients; per head, each block is orthogonalised on its own (and scaled like a whole matrix of that shape). Output
projections mix the heads in their columns and fused QKV matrices interleave three projections, so both stay whole.

A Muon matrix's head count comes from, first match wins:

* the attributes a user sets on the parameter before ``deepspeed.initialize`` (upstream 0.19.8's names):
  ``muon_num_heads`` (an int; 1 keeps the matrix whole) or ``muon_head_dim`` (rows per head);
* ``optimizer.params.per_head_muon: true``: :func:`tag_attention_heads` tags the weights of the q/k/v projections
  below by their module's name, with a head count read from the model's config.

The optimizer reads the result through :func:`head_count`. Nothing here touches optimizer state.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from deepspeed.runtime.zero.muon.math.update import head_rows, matrix_rows
from deepspeed.runtime.zero.muon.param_split import (HEAD_DIM_ATTRIBUTE, NUM_HEADS_ATTRIBUTE, param_shape,
                                                      row_stacked_experts)
from deepspeed.utils.logging import log_dist

# Marks a count that tag_attention_heads derived (not the user's), so the next tagging derives it again from its
# own config instead of keeping it as if a user had set it.
_DERIVED_ATTRIBUTE = "_muon_num_heads_derived"

QUERY_PROJECTIONS = ("q_proj", "query", "wq")
KEY_VALUE_PROJECTIONS = ("k_proj", "v_proj", "key", "value", "wk", "wv")
# DeepSeek's multi-head latent attention: the up-projections from the latent give every head its own rows (of
# another size than head_dim), so their count is the query head count.
MLA_UP_PROJECTIONS = ("q_b_proj", "kv_b_proj")
HEAD_COUNT_KEYS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
KEY_VALUE_HEAD_COUNT_KEY = "num_key_value_heads"
HEAD_DIM_KEY = "head_dim"
# Without head_dim, the hidden size over the query head count gives it (the rows of one k/v head under GQA).
HIDDEN_SIZE_KEYS = ("hidden_size", "d_model", "n_embd", "dim")


def head_count(param: torch.Tensor, name: str | None = None) -> int:
    """The number of row blocks Muon orthogonalises ``param`` in: from its attributes, else 1 (whole).

    Args:
        param: a Muon matrix (rows = its first dimension).
        name: the parameter's name, for messages.

    Raises:
        ValueError: an attribute that is not a positive int, a head count or head size that does not divide the
            rows, or the two attributes disagreeing.
    """
    num_heads = getattr(param, NUM_HEADS_ATTRIBUTE, None)
    head_dim = getattr(param, HEAD_DIM_ATTRIBUTE, None)
    if num_heads is None and head_dim is None:
        return 1
    shape = param_shape(param)
    rows = matrix_rows(shape)
    what = f"parameter {name}" if name else "a parameter"
    what += f" of shape {tuple(shape)}"
    if head_dim is not None:
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
            raise ValueError(f"{what}: {HEAD_DIM_ATTRIBUTE} must be a positive int, got {head_dim!r}")
        if rows % head_dim:
            raise ValueError(f"{what}: {HEAD_DIM_ATTRIBUTE} = {head_dim}, but its {rows} rows are not divisible by "
                             "the head size")
        if num_heads is not None and num_heads != rows // head_dim:
            raise ValueError(f"{what}: {NUM_HEADS_ATTRIBUTE} = {num_heads!r} disagrees with {HEAD_DIM_ATTRIBUTE} = "
                             f"{head_dim} ({rows // head_dim} heads of {head_dim} rows); set one of them")
        return rows // head_dim
    try:
        head_rows(rows, num_heads)
    except ValueError as error:
        raise ValueError(f"{what}: {NUM_HEADS_ATTRIBUTE} = {num_heads!r}: {error}") from None
    return num_heads


@dataclass(frozen=True)
class _Setting:
    """A number from the model's config and where it was read (for messages)."""

    value: int
    source: str


@dataclass(frozen=True)
class _HeadConfig:
    """What the model's config says about attention heads (None where it says nothing)."""

    query_heads: _Setting | None
    key_value_heads: _Setting | None
    head_dim: _Setting | None

    def __str__(self) -> str:
        found = [f"{s.source} = {s.value}" for s in (self.query_heads, self.key_value_heads, self.head_dim) if s]
        return ", ".join(found)


def _read(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)


def _head_config(model: torch.nn.Module) -> tuple[_HeadConfig | None, str]:
    """The model's head counts, or None and why there are none."""
    config = getattr(model, "config", None)
    if config is None:
        return None, "the model has no `config` attribute to read head counts from"
    # Multimodal configs keep the language model's attention in a sub-config.
    text_config = _read(config, "text_config")
    scopes = [(text_config, "model.config.text_config")] if text_config is not None else []
    scopes.append((config, "model.config"))

    def first(*keys: str) -> _Setting | None:
        for scope, where in scopes:
            for key in keys:
                value = _read(scope, key)
                if value is not None:
                    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                        raise ValueError(f"per_head_muon: {where}.{key} must be a positive int, got {value!r}")
                    return _Setting(value, f"{where}.{key}")
        return None

    query_heads, key_value_heads, head_dim = first(*HEAD_COUNT_KEYS), first(KEY_VALUE_HEAD_COUNT_KEY), first(
        HEAD_DIM_KEY)
    if query_heads is None and key_value_heads is None and head_dim is None:
        keys = ", ".join((*HEAD_COUNT_KEYS, KEY_VALUE_HEAD_COUNT_KEY, HEAD_DIM_KEY))
        return None, f"model.config has none of {keys}"
    if head_dim is None and query_heads is not None:
        hidden_size = first(*HIDDEN_SIZE_KEYS)
        if hidden_size is not None and hidden_size.value % query_heads.value == 0:
            head_dim = _Setting(hidden_size.value // query_heads.value, f"{hidden_size.source} / {query_heads.source}")
    return _HeadConfig(query_heads, key_value_heads, head_dim), ""


def _projection_of(name: str) -> str | None:
    """The leaf module name when ``name`` is the weight of a module per_head_muon covers, else None."""
    module, _, leaf = name.rpartition(".")
    if leaf != "weight":
        return None
    projection = module.rpartition(".")[2].lower()
    if projection in QUERY_PROJECTIONS or projection in KEY_VALUE_PROJECTIONS or projection in MLA_UP_PROJECTIONS:
        return projection
    return None


def _derived_count(name: str, param: torch.Tensor, projection: str, config: _HeadConfig) -> int | None:
    """The head count per_head_muon gives a projection's weight; None when the config has nothing for it.

    A head count from the config wins over the head size (the rows per head then follow from the shape, which also
    covers MLA-style projections whose heads are not ``head_dim`` rows): the query count for q and MLA
    up-projections, ``num_key_value_heads`` for k and v. A k or v projection without that count takes rows / head
    size (under grouped-query attention it has fewer heads than the query), else the query count.

    Raises:
        ValueError: the rows are not divisible by that count or head size.
    """
    rows = param.shape[0]
    count = config.query_heads
    if projection in KEY_VALUE_PROJECTIONS:
        if config.key_value_heads is not None:
            count = config.key_value_heads
        elif config.head_dim is not None:
            count = None
    advice = f"set {name}'s {NUM_HEADS_ATTRIBUTE} yourself (1 keeps it whole)"
    if count is not None:
        if rows % count.value:
            raise ValueError(f"per_head_muon: {name} (shape {tuple(param.shape)}) has {rows} rows, not divisible by "
                             f"its head count {count.source} = {count.value}; {advice}")
        return count.value
    if config.head_dim is not None:
        if rows % config.head_dim.value:
            raise ValueError(f"per_head_muon: {name} (shape {tuple(param.shape)}) has {rows} rows, not divisible by "
                             f"the head size {config.head_dim.source} = {config.head_dim.value}; {advice}")
        return rows // config.head_dim.value
    return None


def tag_attention_heads(model: torch.nn.Module, per_head_muon: bool = False) -> dict[str, int]:
    """Tag the Muon matrices that ``per_head_muon`` covers with ``muon_num_heads``; return every Muon matrix that
    will be orthogonalised per head (tagged here or by the user), by name, with its head count.

    Counts an earlier call derived are derived again (or removed); attributes the user set are kept and checked.
    Logs the matrices split by heads (rank 0).

    Args:
        model: the module whose parameters carry ``use_muon`` (see ``deepspeed.tag_muon_params``).
        per_head_muon: the config's ``optimizer.params.per_head_muon``.

    Raises:
        ValueError: ``per_head_muon`` is not a bool; a projection's rows are not divisible by its head count or
            size; a user attribute is invalid (see :func:`head_count`); or ``per_head_muon`` is true and no Muon
            matrix ends up split by heads (the message says why).
    """
    if not isinstance(per_head_muon, bool):
        raise ValueError(f"optimizer.params.per_head_muon must be true or false, got {per_head_muon!r}")
    matrices = [(name, p) for name, p in model.named_parameters() if p.requires_grad and getattr(p, "use_muon", False)]
    for _, param in model.named_parameters():
        if getattr(param, _DERIVED_ATTRIBUTE, False):
            delattr(param, NUM_HEADS_ATTRIBUTE)
            delattr(param, _DERIVED_ATTRIBUTE)
    if per_head_muon:
        _tag_projections(model, matrices)
    tagged, experts = {}, {}
    for name, param in matrices:
        count = head_count(param, name)
        if count > 1:
            (experts if row_stacked_experts(param) else tagged)[name] = count
    for split, unit in ((tagged, "head"), (experts, "expert")):
        if split:
            described = ", ".join(f"{name} ({count} {unit}s of {matrix_rows(param_shape(param)) // count} rows)"
                                  for name, param in matrices if (count := split.get(name)))
            log_dist(f"Muon orthogonalises {len(split)} matrices per {unit}: {described}", ranks=[0],
                     level=logging.INFO)
    return tagged


def _tag_projections(model: torch.nn.Module, matrices: list[tuple[str, torch.Tensor]]) -> None:
    """per_head_muon's part of :func:`tag_attention_heads`: derive and set the counts, or say why none could be."""
    candidates = [(name, param, projection) for name, param in matrices
                  if (projection := _projection_of(name)) is not None]
    config, why_not = _head_config(model) if candidates else (None, "")
    derived = 0
    for name, param, projection in candidates:
        if hasattr(param, NUM_HEADS_ATTRIBUTE) or hasattr(param, HEAD_DIM_ATTRIBUTE):
            continue  # the user's choice
        count = _derived_count(name, param, projection, config) if config is not None else None
        if count is not None and count > 1:
            setattr(param, NUM_HEADS_ATTRIBUTE, count)
            setattr(param, _DERIVED_ATTRIBUTE, True)
            derived += 1
    if derived or any(head_count(param, name) > 1 for name, param in matrices if not row_stacked_experts(param)):
        return
    names = ", ".join((*QUERY_PROJECTIONS, *KEY_VALUE_PROJECTIONS, *MLA_UP_PROJECTIONS))
    if not candidates:
        why_not = f"no Muon matrix is the weight of a module named {names}"
    elif config is not None:
        why_not = (f"the projections found ({', '.join(name for name, _, _ in candidates)}) get no head count above 1 "
                   f"from the config ({config}) or keep the {NUM_HEADS_ATTRIBUTE} a user set")
    raise ValueError(
        f"optimizer.params.per_head_muon is true, but no Muon matrix can be orthogonalised per head: {why_not}. "
        f"It tags the weights of q/k/v projections (modules named {names}) with a head count from model.config "
        f"({', '.join(HEAD_COUNT_KEYS)}; {KEY_VALUE_HEAD_COUNT_KEY} for k/v; {HEAD_DIM_KEY}; text_config of a "
        f"multimodal config); output projections and fused QKV matrices stay whole. Set {NUM_HEADS_ATTRIBUTE} (or "
        f"{HEAD_DIM_ATTRIBUTE}) on a parameter to choose yourself, or remove per_head_muon")
