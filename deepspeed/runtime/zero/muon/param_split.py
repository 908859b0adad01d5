"""Which parameters Muon takes: the `use_muon` tag `deepspeed.initialize` sets on each trainable parameter.

Two rules, chosen by `optimizer.params.param_split`:

- "hidden" (the default): Muon takes the hidden matrices, the convention of the Muon reference and its peers;
  the Adam group takes embeddings (weights of `torch.nn.Embedding` / `EmbeddingBag` modules), the output head
  (`model.get_output_embeddings()` where the model has it, as Hugging Face models do, and any module named
  `lm_head`), a head tied to an embedding (it is the embedding's weight), every parameter with fewer than 2
  dims (norms, biases, scalars), and biases and norm scales of more dims (a parameter its module names "bias" or
  "..._bias", or of a module whose class name ends in "Norm": a stack of vectors, one per expert or head, which
  Newton-Schulz would mix), and a state-space mixer's `A_log` and `D` (element-wise decay rates and skip scales of a
  module that has an `A_log`). A head of another name in a model
  without `get_output_embeddings` is a matrix like any other: tag it `use_muon = False`.
- "upstream": upstream DeepSpeed's rule: Muon for every parameter with 2 or more dims whose name contains neither
  "embed" nor "lm_head".

A parameter that already has a `use_muon` attribute keeps it: the user's choice wins under both rules.

Mixture-of-experts models need no rule of their own: a router's weight (a matrix [experts, hidden]) is a hidden
matrix, so Muon takes it under both rules, and its bias, where it has one, is a vector for Adam; a fused expert
tensor [experts, out, in] goes to Muon whole, which orthogonalises it as `experts` matrices (`matrix_blocks`), and
its fused biases [experts, out] (GPT-OSS's) go to Adam under "hidden", being one bias vector per expert. Experts
stacked by rows in a 2-D parameter (DBRX's [experts * ffn, hidden]) get a head count of one block per expert, under
both rules, so that each expert is orthogonalised on its own (`muon_num_heads`, read by muon/per_head.py). The
log line counts both: Muon's tensors as the matrices Newton-Schulz sees, and the router weights among them.
"""

from dataclasses import dataclass, field

import torch

from deepspeed.runtime.constants import MUON_PARAM_SPLITS as PARAM_SPLITS
from deepspeed.runtime.zero.muon.math.update import matrix_blocks

DEFAULT_PARAM_SPLIT = "hidden"
_EMBEDDINGS = (torch.nn.Embedding, torch.nn.EmbeddingBag)
# Attributes by which a module says how many experts it holds (transformers' experts modules; DBRX's DbrxExpertGLU
# says moe_num_experts).
EXPERT_COUNT_ATTRIBUTES = ("num_experts", "moe_num_experts", "num_local_experts")
# The per-head attributes (muon/per_head.py reads them): a matrix's rows split into that many blocks, or blocks of
# that many rows.
NUM_HEADS_ATTRIBUTE, HEAD_DIM_ATTRIBUTE = "muon_num_heads", "muon_head_dim"
# Marks a muon_num_heads that tag_muon_params set from an expert count (not the user's), so that the next tagging
# sets it again from the model as it is then.
_EXPERTS_DERIVED_ATTRIBUTE = "_muon_num_heads_experts"


def param_shape(param: torch.Tensor) -> torch.Size:
    # A zero.Init parameter's data is an empty placeholder: its shape is `ds_shape`.
    return getattr(param, "ds_shape", param.shape)


@dataclass
class ParamSplit:
    """What the tagging decided, for the log line: tensors and elements per group, and why Adam took what it took."""

    muon: list = field(default_factory=list)  # (name, numel)
    adam: list = field(default_factory=list)  # (name, numel, reason)
    matrices: dict = field(default_factory=dict)  # Muon tensor name -> the matrices Newton-Schulz sees in it
    routers: list = field(default_factory=list)  # names of the Muon tensors that are MoE routers' weights

    def summary(self, rule: str) -> str:
        muon_numel = sum(numel for _, numel in self.muon)
        adam_numel = sum(numel for _, numel, _ in self.adam)
        reasons: dict = {}
        for _, numel, reason in self.adam:
            count, total = reasons.get(reason, (0, 0))
            reasons[reason] = (count + 1, total + numel)
        detail = ", ".join(f"{reason} {count} ({total:,})" for reason, (count, total) in sorted(reasons.items()))
        return (f"Muon param split ({rule}): Muon {len(self.muon)} tensors{self._muon_detail(muon_numel)}, "
                f"Adam {len(self.adam)} tensors ({adam_numel:,} params){': ' + detail if detail else ''}")

    def _muon_detail(self, muon_numel: int) -> str:
        """' (n params)', or for a model with batched tensors or routers ' = m matrices (n params; ...)'."""
        batched = {name: count for name, count in self.matrices.items() if count > 1}
        notes = []
        if batched:
            # Tensors of more than two dims other than conv kernels: in practice fused experts [experts, out, in].
            notes.append(f"fused experts {len(batched)} tensors = {sum(batched.values())} matrices")
        if self.routers:
            notes.append(f"routers {len(self.routers)}")
        if not notes:
            return f" ({muon_numel:,} params)"
        return f" = {sum(self.matrices.values())} matrices ({muon_numel:,} params; {', '.join(notes)})"


def _head_modules(model: torch.nn.Module) -> set:
    """ids of the modules that are the model's output head."""
    heads = set()
    get_output = getattr(model, "get_output_embeddings", None)
    if callable(get_output):
        try:
            output = get_output()
        except (NotImplementedError, AttributeError):
            output = None
        if isinstance(output, torch.nn.Module):
            heads.add(id(output))
    for name, module in model.named_modules():
        if name.split(".")[-1] == "lm_head":
            heads.add(id(module))
    return heads


def _router_params(model: torch.nn.Module) -> set:
    """ids of the parameters of MoE routers: modules whose class name contains "Router" (transformers names every
    router so: MixtralTopKRouter, Qwen3MoeTopKRouter, SwitchTransformersTop1Router, ...) and their submodules."""
    return {id(param) for module in model.modules() if "router" in type(module).__name__.lower()
            for param in module.parameters()}


def _is_bias(attribute: str) -> bool:
    """A parameter its module calls "bias" or "..._bias": bias vectors, one per row where it has two dims or more
    (GPT-OSS's experts.gate_up_proj_bias [experts, 2 * intermediate], XLNet's r_w_bias [heads, head_dim])."""
    return attribute == "bias" or attribute.endswith("_bias")


# A state-space (Mamba) mixer's element-wise parameters, by the names every such mixer in transformers gives them: the
# log decay rates A_log ([channels, state] in Mamba, Falcon-Mamba and Jamba; more dims in Zamba and Kimi-Linear) and
# the skip scales D. Each entry is a rate or a scale of its own, not a linear map.
_STATE_SPACE_PARAMETERS = ("A_log", "D")


def _is_norm(module: torch.nn.Module) -> bool:
    """A normalisation layer (torch's and transformers' classes are all named ...Norm): its parameters are
    element-wise scales and shifts, one per row where they have two dims (Ergo's ErgoExpertNorm [experts, hidden])."""
    return type(module).__name__.endswith("Norm")


def _hidden_rule(model: torch.nn.Module) -> dict:
    """id(param) -> None (Muon) or the reason it goes to Adam, for every parameter of `model`."""
    heads = _head_modules(model)
    reasons = {}
    for module in model.modules():
        reason = "embedding" if isinstance(module, _EMBEDDINGS) else "head" if id(module) in heads else None
        state_space = hasattr(module, _STATE_SPACE_PARAMETERS[0])
        for attribute, param in module.named_parameters(recurse=False):
            if len(param_shape(param)) < 2:
                reasons.setdefault(id(param), "vector")
            elif _is_bias(attribute):
                reasons.setdefault(id(param), "stacked bias")
            elif _is_norm(module):
                reasons.setdefault(id(param), "stacked norm")
            elif state_space and attribute in _STATE_SPACE_PARAMETERS:
                reasons.setdefault(id(param), "state-space decay")
            elif reason is not None:
                # An embedding's verdict wins over a head's for a tied weight (both say Adam).
                reasons[id(param)] = reasons.get(id(param)) or reason
            else:
                reasons.setdefault(id(param), None)
    return reasons


def _expert_count(module: torch.nn.Module) -> int | None:
    for attribute in EXPERT_COUNT_ATTRIBUTES:
        count = getattr(module, attribute, None)
        if isinstance(count, int) and not isinstance(count, bool):
            return count
    return None


def _row_stacked_experts(model: torch.nn.Module) -> dict:
    """id(param) -> E for the experts stacked by rows in one matrix: a 2-D parameter of a module that holds E > 1
    experts (one of EXPERT_COUNT_ATTRIBUTES), whose rows are E equal blocks of more than one row (DBRX's w1, v1, w2
    [experts * ffn, hidden], expert e's matrix its rows e * ffn to (e + 1) * ffn). A router's weight [experts, hidden]
    has one row per expert: a matrix."""
    counts = {}
    for module in model.modules():
        count = _expert_count(module)
        if count is None or count < 2:
            continue
        for param in module.parameters(recurse=False):
            shape = param_shape(param)
            if len(shape) == 2 and shape[0] > count and shape[0] % count == 0:
                counts[id(param)] = count
    return counts


def _tag_row_stacked_experts(model: torch.nn.Module) -> None:
    """Orthogonalise each expert of a row-stacked expert matrix on its own: ``muon_num_heads`` = the expert count
    (the per-head path splits the rows into that many blocks), unless the user set a head count or size."""
    for param in model.parameters():
        if getattr(param, _EXPERTS_DERIVED_ATTRIBUTE, False):
            delattr(param, NUM_HEADS_ATTRIBUTE)
            delattr(param, _EXPERTS_DERIVED_ATTRIBUTE)
    counts = _row_stacked_experts(model)
    for param in model.parameters():
        count = counts.get(id(param))
        if (count is None or not getattr(param, "use_muon", False) or hasattr(param, NUM_HEADS_ATTRIBUTE)
                or hasattr(param, HEAD_DIM_ATTRIBUTE)):
            continue
        setattr(param, NUM_HEADS_ATTRIBUTE, count)
        setattr(param, _EXPERTS_DERIVED_ATTRIBUTE, True)


def row_stacked_experts(param: torch.Tensor) -> bool:
    """Whether ``param``'s head count is the expert count :func:`tag_muon_params` gave a row-stacked expert matrix."""
    return bool(getattr(param, _EXPERTS_DERIVED_ATTRIBUTE, False))


def _upstream_reason(name: str, param: torch.Tensor):
    lowered = name.lower()
    if len(param_shape(param)) < 2:
        return "vector"
    if "embed" in lowered or "lm_head" in lowered:
        return "named embed or lm_head"
    return None


def tag_muon_params(model: torch.nn.Module, param_split: str = DEFAULT_PARAM_SPLIT) -> ParamSplit:
    """Set `use_muon` on every parameter of `model` that has no such attribute yet, by `param_split`'s rule.

    Returns:
        The split of the trainable parameters (explicit tags included), for the log line.

    Raises:
        ValueError: an unknown `param_split`.
    """
    if param_split not in PARAM_SPLITS:
        raise ValueError(f"param_split must be one of {list(PARAM_SPLITS)}, got {param_split!r}")
    reasons = _hidden_rule(model) if param_split == "hidden" else None
    adam_reasons = {}
    for name, param in model.named_parameters():
        if not hasattr(param, "use_muon"):
            reason = reasons.get(id(param)) if reasons is not None else _upstream_reason(name, param)
            param.use_muon = reason is None
        else:
            reason = None if param.use_muon else "tagged use_muon=False"
        adam_reasons[name] = reason or "tagged use_muon=False"
    _tag_row_stacked_experts(model)
    routers = _router_params(model)
    split = ParamSplit()
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        numel = param_shape(param).numel()
        if param.use_muon:
            split.muon.append((name, numel))
            if len(param_shape(param)) >= 2:
                experts = param.muon_num_heads if row_stacked_experts(param) else 1
                split.matrices[name] = matrix_blocks(param_shape(param), experts)[0]
            if id(param) in routers:
                split.routers.append(name)
        else:
            split.adam.append((name, numel, adam_reasons[name]))
    return split
