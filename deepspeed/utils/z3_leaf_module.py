"""ZeRO stage 3 leaf modules: a module whose parameters (its own and all its descendants') are gathered together.

A leaf is gathered as one unit when its forward starts and released when it ends (and again around its backward),
and nothing below it is gathered on its own. This is what a mixture-of-experts block needs: the ranks' tokens pick
different experts, so gathering expert by expert as each one runs would have the ranks issue different collectives
(a hang), and an expert a rank skips would never be gathered there. Flags are read when `deepspeed.initialize` builds
the stage-3 units (zero/param_residency.py): set them before it. They have no effect at stages 0-2.

The flag is upstream's `_z3_leaf` attribute on the module; a parameter of a leaf carries `ds_z3_leaf_module` (the
leaf) once stage 3 manages it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, List, Sequence, Tuple, Type, Union

from deepspeed.utils.logging import logger

if TYPE_CHECKING:  # annotations only: deepspeed.utils imports this module, and the launcher imports deepspeed.utils
    import torch

ModuleClasses = Sequence[Union[Type["torch.nn.Module"], str]]

# Upstream's `zero_optimization.leaf_module.classes` default: the MoE blocks of transformers models whose experts
# are chosen per token.
DEFAULT_LEAF_MODULE_CLASSES: Tuple[str, ...] = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)


def z3_leaf_module(model: torch.nn.Module) -> bool:
    """True when `model` is flagged as a leaf."""
    return bool(getattr(model, "_z3_leaf", False))


def z3_leaf_parameter(param: torch.nn.Parameter) -> bool:
    """True when `param` belongs to a leaf module (set when stage 3 builds its units)."""
    return hasattr(param, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    """Every module of `model` (itself included) flagged as a leaf, in `model.modules()` order."""
    return [module for module in model.modules() if z3_leaf_module(module)]


def set_z3_leaf_module(model: torch.nn.Module, flag: bool) -> None:
    """Flag (or unflag) the one module `model`."""
    model._z3_leaf = flag


def _class_matches(module: torch.nn.Module, wanted: Union[Type[torch.nn.Module], str]) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    cls = type(module)
    return wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _flag_by_class(model: torch.nn.Module, classes: ModuleClasses, flag: bool,
                   raise_if_not_found: bool) -> List[torch.nn.Module]:
    classes = list(classes)
    wrong = [c for c in classes if not isinstance(c, (type, str))]
    if wrong:
        raise TypeError(f"leaf_module_classes must be module classes or class names, got {wrong!r}")
    matched = []
    for module in model.modules():
        if any(_class_matches(module, wanted) for wanted in classes):
            set_z3_leaf_module(module, flag)
            matched.append(module)
    if not matched and raise_if_not_found:
        raise ValueError(f"No modules of type {classes} found in model {type(model).__name__}")
    return matched


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: ModuleClasses,
                        raise_if_not_found: bool = True) -> List[torch.nn.Module]:
    """Flag every module of `model` that is an instance of one of `leaf_module_classes` as a ZeRO-3 leaf.

    Args:
        model: the model (before `deepspeed.initialize`).
        leaf_module_classes: classes, or class names (bare `__name__` or fully qualified `module.QualName`).
        raise_if_not_found: raise ValueError when nothing matches.

    Returns:
        The flagged modules.
    """
    return _flag_by_class(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: ModuleClasses,
                          raise_if_not_found: bool = True) -> List[torch.nn.Module]:
    """Clear the leaf flag of every module of `model` that is an instance of one of `leaf_module_classes`."""
    return _flag_by_class(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(model: torch.nn.Module, module_names: Iterable[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> Tuple[List[torch.nn.Module], List[str]]:
    """Set the leaf flag of the modules named (as `model.named_modules()` names them).

    Returns:
        (the modules flagged, the names that matched no module).
    """
    by_name = dict(model.named_modules())
    matched, missing = [], []
    for name in module_names:
        module = by_name.get(name)
        if module is None:
            missing.append(name)
            continue
        set_z3_leaf_module(module, flag)
        matched.append(module)
    if missing and raise_if_not_found:
        raise ValueError(f"No modules named {missing} found in model {type(model).__name__}")
    return matched, missing


def set_z3_leaf_modules_by_suffix(model: torch.nn.Module, module_name_suffixes: Iterable[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> Tuple[List[torch.nn.Module], List[str]]:
    """Set the leaf flag of every module whose `named_modules()` name ends with one of the suffixes.

    Returns:
        (the modules flagged, each once; the suffixes that matched no module).
    """
    by_name = dict(model.named_modules())
    matched, missing, seen = [], [], set()
    for suffix in module_name_suffixes:
        hits = [module for name, module in by_name.items() if name.endswith(suffix)]
        if not hits:
            missing.append(suffix)
        for module in hits:
            set_z3_leaf_module(module, flag)
            if id(module) not in seen:
                seen.add(id(module))
                matched.append(module)
    if missing and raise_if_not_found:
        raise ValueError(f"No modules matching suffixes {missing} found in model {type(model).__name__}")
    return matched, missing


def apply_zero_leaf_module_config(model: torch.nn.Module, leaf_config) -> List[torch.nn.Module]:
    """Flag the modules `zero_optimization.leaf_module` names (classes, names, name_suffixes); unmatched names
    and suffixes that differ from the defaults are warned about, never an error (as upstream)."""
    matched, seen = [], set()

    def add(modules):
        for module in modules:
            if id(module) not in seen:
                seen.add(id(module))
                matched.append(module)

    add(set_z3_leaf_modules(model, leaf_config.classes, raise_if_not_found=False))
    modules, missing = set_z3_leaf_modules_by_name(model, leaf_config.names, raise_if_not_found=False)
    add(modules)
    if missing:
        logger.warning(f"zero_optimization.leaf_module.names: no module named {missing}")
    modules, missing = set_z3_leaf_modules_by_suffix(model, leaf_config.name_suffixes, raise_if_not_found=False)
    add(modules)
    if missing:
        logger.warning(f"zero_optimization.leaf_module.name_suffixes: no module name ends with {missing}")
    customised = (list(leaf_config.classes) != list(DEFAULT_LEAF_MODULE_CLASSES) or leaf_config.names
                  or leaf_config.name_suffixes)
    if customised and not matched:
        logger.warning("zero_optimization.leaf_module matched no module; every module with parameters of its own is "
                       "gathered on its own")
    return matched
