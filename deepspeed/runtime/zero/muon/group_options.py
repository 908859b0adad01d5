"""MuonWithAuxAdam's param groups: the options each kind of group takes, their defaults and checks, and the groups
built from the DeepSpeed config's ``optimizer.params``.

What a group may say is stated here once; ``MuonWithAuxAdam.add_param_group`` asks :func:`checked_group`, and
:func:`muon_param_groups` builds the groups the engine hands it (the config's values were checked when it was
parsed, with the config key in the message: ``deepspeed/runtime/optimizer_params.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from deepspeed.runtime.constants import MUON_OPTIMIZER
from deepspeed.runtime.optimizer_params import MuonParams, validate_optimizer_params
from deepspeed.runtime.zero.muon.math.normuon import NORMUON_BETA2, NORMUON_EPS
from deepspeed.runtime.zero.muon.math.ns_coefficients import DEFAULT_NS_COEFFICIENTS, check_ns_coefficients
from deepspeed.runtime.zero.muon.math.newton_schulz import check_ns_method
from deepspeed.runtime.zero.muon.math.update import ADJUST_LR_FNS, MOMENTUM_DTYPES

MUON_DEFAULTS: dict[str, Any] = {
    "lr": 0.02,
    "momentum": 0.95,
    "weight_decay": 0.0,
    "ns_method": "auto",
    "ns_coefficients": DEFAULT_NS_COEFFICIENTS,
    "ns_steps": 5,
    "nesterov": True,
    "ns_dtype": None,
    "ns_cuda_graph": False,
    "adjust_lr_fn": "original",
    "momentum_dtype": torch.float32,
    "normuon": False,
    "normuon_beta2": NORMUON_BETA2,
    "normuon_eps": NORMUON_EPS,
}
ADAM_DEFAULTS: dict[str, Any] = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}

_GROUP_KEYS = frozenset({"params", "use_muon", "name"})
# Added by torch itself ('param_names' for (name, param) lists) or by its LR schedulers and SWA, so a
# group copied from a live optimizer must still be accepted.
_TORCH_ADDED_KEYS = frozenset(
    {"param_names", "initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum", "swa_lr"}
)

MUON_GROUP_NAME = "muon-params"
ADAM_GROUP_NAME = "adam-params"

# The config's dtype names (ns_dtype: constants.MUON_NS_DTYPES; momentum_dtype: constants.MUON_MOMENTUM_DTYPES)
# as torch dtypes.
_DTYPES_BY_NAME = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


MISSING_USE_MUON_MESSAGE = (
    "Muon optimizer is used, but the use_muon attribute is NOT configured for some of the model parameters, "
    "please set by `param.use_muon = True / False` for all params"
)


def checked_group(index: int, param_group: dict[str, Any]) -> dict[str, Any]:
    """``param_group`` (the ``index``-th of a MuonWithAuxAdam) checked, as a new dict with its defaults filled in.

    Raises:
        ValueError: a group without ``use_muon``, an unknown key, or a Muon option of the wrong type or range (see
            MuonWithAuxAdam); the message names the group.
    """
    if "use_muon" not in param_group:
        raise ValueError(f"MuonWithAuxAdam param group {index} has no 'use_muon' key; set it to True or False")
    is_muon = bool(param_group["use_muon"])
    defaults = MUON_DEFAULTS if is_muon else ADAM_DEFAULTS
    for key in param_group:
        if key not in defaults and key not in _GROUP_KEYS and key not in _TORCH_ADDED_KEYS:
            kind = "Muon" if is_muon else "Adam"
            raise ValueError(
                f"MuonWithAuxAdam param group {index}: unknown key '{key}' for a {kind} group; "
                f"allowed: {sorted(_GROUP_KEYS | defaults.keys())}"
            )
    group = {**defaults, **param_group}
    if is_muon:
        _check_muon_options(index, group)
    return group


def _check_muon_options(index: int, group: dict[str, Any]) -> None:
    """Raise ValueError naming the group and the option for a Muon option of the wrong type or range."""
    check_ns_method(group["ns_method"])
    try:
        check_ns_coefficients(group["ns_coefficients"])
    except ValueError as error:
        raise ValueError(f"MuonWithAuxAdam param group {index}: {error}") from None
    if not isinstance(group["ns_cuda_graph"], bool):
        raise ValueError(f"MuonWithAuxAdam param group {index}: ns_cuda_graph must be true or false, "
                         f"got {group['ns_cuda_graph']!r}")
    steps = group["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        # Fewer than one iteration would apply the raw momentum: no orthogonalisation, no error.
        raise ValueError(f"MuonWithAuxAdam param group {index}: ns_steps must be an integer >= 1, got "
                         f"{steps!r}")
    for key in ("momentum", "normuon_beta2"):
        beta = group[key]
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < 1:
            raise ValueError(f"MuonWithAuxAdam param group {index}: {key} must be a number in [0, 1), got "
                             f"{beta!r}")
    if not isinstance(group["normuon"], bool):
        raise ValueError(f"MuonWithAuxAdam param group {index}: normuon must be true or false, got "
                         f"{group['normuon']!r}")
    eps = group["normuon_eps"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"MuonWithAuxAdam param group {index}: normuon_eps must be a number > 0, got {eps!r}")
    if group["momentum_dtype"] not in MOMENTUM_DTYPES:
        raise ValueError(f"MuonWithAuxAdam param group {index}: momentum_dtype must be torch.float32 or "
                         f"torch.bfloat16, got {group['momentum_dtype']!r}")
    if group["ns_dtype"] is not None and not isinstance(group["ns_dtype"], torch.dtype):
        raise ValueError(
            f"MuonWithAuxAdam param group {index}: ns_dtype must be a torch.dtype or None, "
            f"got {group['ns_dtype']!r}"
        )
    if group["adjust_lr_fn"] is None:
        group["adjust_lr_fn"] = "original"  # torch.optim.Muon's meaning of None
    if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise ValueError(f"MuonWithAuxAdam param group {index}: adjust_lr_fn must be one of "
                         f"{list(ADJUST_LR_FNS)} or None, got {group['adjust_lr_fn']!r}")


def muon_param_groups(
    named_params: Iterable[tuple[str, torch.nn.Parameter]], optimizer_params: Mapping[str, Any] | None
) -> list[dict[str, Any]]:
    """Build MuonWithAuxAdam's groups from ``p.use_muon`` tags and the config's ``optimizer.params``.

    At most two groups, Muon first (``name`` 'muon-params') then Adam ('adam-params'), holding only
    params with ``requires_grad``; an empty group is omitted. Which key configures which group is
    :class:`~deepspeed.runtime.optimizer_params.MuonParams`' table: ``lr`` and ``weight_decay`` apply to
    both groups; ``muon_lr`` / ``adam_lr`` override ``lr`` for one; ``momentum``, ``ns_method``,
    ``ns_coefficients``, ``ns_steps``, ``nesterov``, ``ns_dtype`` ('fp32', 'bf16', 'fp16'), ``ns_cuda_graph`` and
    ``adjust_lr_fn`` ('original', 'match_rms_adamw'), ``momentum_dtype`` ('fp32', 'bf16'), ``normuon``,
    ``normuon_beta2`` and ``normuon_eps`` are Muon's; ``betas`` and ``eps`` are Adam's. Upstream silently drops
    ``nesterov`` and ``ns_steps``; we honour them. ``per_head_muon`` is validated and left to the caller, who tags
    the model with it (``per_head.tag_attention_heads``) before building the optimizer.

    Args:
        named_params: (name, param) pairs, e.g. ``model.named_parameters()``.
        optimizer_params: the ``optimizer.params`` dict of the DeepSpeed config, or None.

    Returns:
        The param groups, ready for ``MuonWithAuxAdam``.

    Raises:
        DeepSpeedConfigError: an unknown key or an invalid value in ``optimizer_params`` (a ValueError).
        ValueError: a trainable param without a ``use_muon`` attribute (upstream's message plus the names).
    """
    muon_options, adam_options = MuonParams.group_options(
        validate_optimizer_params(MUON_OPTIMIZER, dict(optimizer_params or {}))
    )
    trainable = [(name, p) for name, p in named_params if p.requires_grad]
    untagged = [name for name, p in trainable if not hasattr(p, "use_muon")]
    if untagged:
        raise ValueError(f"{MISSING_USE_MUON_MESSAGE}; missing on: {untagged}")

    muon_group = {"params": [p for _, p in trainable if p.use_muon], "use_muon": True, "name": MUON_GROUP_NAME}
    muon_group.update(muon_options)
    if muon_group.get("ns_dtype") is not None:
        muon_group["ns_dtype"] = _DTYPES_BY_NAME[muon_group["ns_dtype"]]
    if "momentum_dtype" in muon_group:
        muon_group["momentum_dtype"] = _DTYPES_BY_NAME[muon_group["momentum_dtype"]]
    adam_group = {"params": [p for _, p in trainable if not p.use_muon], "use_muon": False, "name": ADAM_GROUP_NAME}
    adam_group.update(adam_options)
    return [group for group in (muon_group, adam_group) if group["params"]]
