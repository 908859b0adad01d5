"""Only deepspeed/comm may use torch.distributed; everything else goes through deepspeed.comm."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "deepspeed"
ALLOWED = PACKAGE / "comm"
FORBIDDEN = "torch.distributed"


def _is_forbidden_module(name: str | None) -> bool:
    return name is not None and (name == FORBIDDEN or name.startswith(FORBIDDEN + "."))


def _torch_aliases(tree: ast.AST) -> set[str]:
    """Return the names bound to the torch module (`import torch`, `import torch as th`, `import torch.nn`)."""
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch" or (alias.name.startswith("torch.") and alias.asname is None):
                    aliases.add(alias.asname or "torch")
    return aliases


def torch_distributed_uses(source: str, filename: str = "<source>") -> list[str]:
    """Return 'line: what' for every use of torch.distributed in `source`, whatever the spelling."""
    tree = ast.parse(source, filename)
    torch_names = _torch_aliases(tree) | {"torch"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if _is_forbidden_module(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            if _is_forbidden_module(node.module):
                found.append(f"{node.lineno}: from {node.module} import ...")
            elif node.module == "torch" and any(a.name == "distributed" for a in node.names):
                found.append(f"{node.lineno}: from torch import distributed")
        elif isinstance(node, ast.Attribute) and node.attr == "distributed":
            if isinstance(node.value, ast.Name) and node.value.id in torch_names:
                found.append(f"{node.lineno}: {node.value.id}.distributed")
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            callee = ast.unparse(node.func)
            if (
                callee in ("importlib.import_module", "import_module", "__import__")
                and isinstance(node.args[0].value, str)
                and _is_forbidden_module(node.args[0].value)
            ):
                found.append(f"{node.lineno}: {callee}({node.args[0].value!r})")
    return found


@pytest.mark.parametrize(
    "source",
    [
        "import torch.distributed",
        "import torch.distributed as dist",
        "import torch.distributed.fsdp",
        "import os, torch.distributed.checkpoint as dcp",
        "from torch.distributed import ReduceOp",
        "from torch.distributed.distributed_c10d import _get_default_group",
        "from torch import distributed",
        "from torch import nn, distributed as d",
        "import torch\ntorch.distributed.all_reduce(x)",
        "import torch as th\nth.distributed.get_rank()",
        "import torch.nn\nif torch.distributed.is_initialized(): pass",
        "import importlib\nimportlib.import_module('torch.distributed')",
        "__import__('torch.distributed.rpc')",
        "def f():\n    import torch.distributed as dist\n    return dist",
    ],
)
def test_checker_catches_every_spelling(source):
    assert torch_distributed_uses(source), f"not caught: {source!r}"


@pytest.mark.parametrize(
    "source",
    [
        "import torch",
        "import torch.nn as nn",
        "from torch import nn, optim",
        "import torch.distributions as D",
        "from torch.distributions import Normal",
        "import deepspeed.comm as dist\ndist.all_reduce(x)",
        "from . import distributed",
        "obj.distributed = True",
    ],
)
def test_checker_allows_other_code(source):
    assert torch_distributed_uses(source) == []


def test_only_deepspeed_comm_uses_torch_distributed():
    files = [path for path in sorted(PACKAGE.rglob("*.py")) if ALLOWED not in path.parents]
    assert files, f"no modules found under {PACKAGE}"
    violations = [
        f"{path.relative_to(PACKAGE.parent)}:{use}"
        for path in files
        for use in torch_distributed_uses(path.read_text(), str(path))
    ]
    assert not violations, "torch.distributed used outside deepspeed/comm (use deepspeed.comm):\n" + "\n".join(
        violations
    )


# ---------------------------------------------------------------------------------------------- the import graph
def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """deepspeed module -> the deepspeed modules it imports, at module level or inside functions.

    A module's import of one of its own parent packages is left out: a package and its submodules are one unit.
    """
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, cycles, counter = {}, {}, set(), [], [], [0]

    def visit(root: str) -> None:
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_no_import_cycles():
    assert import_cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_utils_import_nothing_from_the_runtime():
    graph = import_graph()
    upward = {name: sorted(t for t in targets if t.startswith("deepspeed.runtime"))
              for name, targets in graph.items() if name.startswith("deepspeed.utils")}
    assert {name: targets for name, targets in upward.items() if targets} == {}


# ------------------------------------------------------------------------------------------------------ the layers
# Lowest first: a module imports only from its own layer or below. The checkpoint package reads and writes the
# runtime's pieces through the state they declare (runtime/engine_state.py, runtime/zero/rank_state.py), so no piece
# imports it; the engine assembles the pieces and the checkpoint package; the package face (`deepspeed/__init__.py`,
# the launcher, env_report) sits on top.
LAYERS = [
    ("base", ("deepspeed.accelerator", "deepspeed.comm", "deepspeed.utils", "deepspeed.git_version_info",
              "deepspeed.git_version_info_installed", "deepspeed.not_provided")),
    ("pieces", ("deepspeed.ops", "deepspeed.runtime")),
    ("checkpoint", ("deepspeed.checkpoint", )),
    ("engine", ("deepspeed.runtime.engine", "deepspeed.runtime.engine_setup")),
    ("face", ("deepspeed", "deepspeed.launcher", "deepspeed.env_report")),
]
# Upstream's public paths kept as thin re-exports of a higher layer's module.
RE_EXPORTS = {("deepspeed.utils.zero_to_fp32", "deepspeed.checkpoint.zero_to_fp32")}


def layer_of(module: str) -> int:
    """The layer of the longest prefix of `module` that LAYERS names."""
    best, level = -1, None
    for number, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), number
    assert level is not None, f"{module} is in no layer of LAYERS"
    return level


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{name} ({LAYERS[layer_of(name)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
                  for name, targets in graph.items() for target in targets
                  if layer_of(target) > layer_of(name) and (name, target) not in RE_EXPORTS)


def test_no_module_imports_from_a_higher_layer():
    assert upward_imports(import_graph()) == []


def test_the_layer_check_sees_an_upward_import():
    assert upward_imports({"deepspeed.checkpoint.engine_io": {"deepspeed.runtime.engine"},
                           "deepspeed.runtime.zero.stage_1_and_2": {"deepspeed.checkpoint.zero_state"},
                           "deepspeed.runtime.engine": {"deepspeed.checkpoint.engine_io"}}) == [
        "deepspeed.checkpoint.engine_io (checkpoint) imports deepspeed.runtime.engine (engine)",
        "deepspeed.runtime.zero.stage_1_and_2 (pieces) imports deepspeed.checkpoint.zero_state (checkpoint)"]


def checkpoint_imports_of_zero(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """The ZeRO wrapper's modules (runtime/zero) that import the checkpoint package, at module level or inside a
    function: the wrapper declares its state (rank_state.py) and the checkpoint package reads it, not the reverse."""
    found = {}
    for name, targets in graph.items():
        if name == "deepspeed.runtime.zero" or name.startswith("deepspeed.runtime.zero."):
            bad = sorted(t for t in targets if t == "deepspeed.checkpoint" or t.startswith("deepspeed.checkpoint."))
            if bad:
                found[name] = bad
    return found


def test_the_zero_wrapper_never_imports_the_checkpoint_package():
    graph = import_graph()
    assert "deepspeed.runtime.zero.stage_1_and_2" in graph and "deepspeed.runtime.zero.stage3" in graph
    assert checkpoint_imports_of_zero(graph) == {}


def test_the_zero_import_check_sees_the_checkpoint_package():
    assert checkpoint_imports_of_zero({
        "deepspeed.runtime.zero.stage_1_and_2": {"deepspeed.checkpoint.zero_state", "deepspeed.comm"},
        "deepspeed.runtime.zero.stage3": {"deepspeed.checkpoint"},
        "deepspeed.runtime.zero.rank_state": {"deepspeed.runtime.zero.flat_layout"},
        "deepspeed.runtime.engine": {"deepspeed.checkpoint.engine_io"}}) == {
            "deepspeed.runtime.zero.stage_1_and_2": ["deepspeed.checkpoint.zero_state"],
            "deepspeed.runtime.zero.stage3": ["deepspeed.checkpoint"]}


# ------------------------------------------------------------------------- the checkpoint package's private reads
CHECKPOINT = PACKAGE / "checkpoint"
_ATTRIBUTE_CALLS = ("getattr", "hasattr", "setattr", "delattr")


def _is_private(name: str) -> bool:
    """`_x` and `__x` are private; `__x__` (the language's own) is not."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_names(tree: ast.AST) -> set[str]:
    """Names bound by an import: `torch._utils` reads a module's private name, not an object's."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return names


def private_attribute_reads(source: str, filename: str = "<source>") -> list[str]:
    """Return 'line: what' for every private attribute of another object that `source` reads or writes.

    Caught: `engine._config`, `opt._offload.x`, `f()._x`, `getattr(engine, "_config")` (and hasattr, setattr,
    delattr), `obj.__dict__["_x"]`, `vars(obj)["_x"]`. Allowed: `self._x` / `cls._x` (a class's own), a module's
    names (`torch._utils`), dunders (`__class__`), and calling this module's own `_helpers()` (a name, not an
    attribute).
    """
    tree = ast.parse(source, filename)
    allowed_owners = {"self", "cls"} | _module_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in allowed_owners):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _ATTRIBUTE_CALLS:
            if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) \
                    and _is_private(node.args[1].value) \
                    and not (isinstance(node.args[0], ast.Name) and node.args[0].id in allowed_owners):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
                and isinstance(node.slice.value, str) and _is_private(node.slice.value):
            owner = node.value
            if (isinstance(owner, ast.Attribute) and owner.attr == "__dict__") or (
                    isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "vars"):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize(
    "source",
    [
        "def f(engine):\n    return engine._config.checkpoint_config",
        "def f(engine):\n    engine._step_applied = False",
        "def f(engine):\n    return engine.optimizer._offload",
        "def f(engine):\n    return engine.optimizer.single_partition_of_fp32_groups[0]._base",
        "def f(view):\n    return view.optimizer.state_layout()._layouts",
        "def f(engine):\n    return getattr(engine, '_config')",
        "def f(opt):\n    return hasattr(opt, '_offload')",
        "def f(engine):\n    setattr(engine, '_config', None)",
        "def f(engine):\n    return engine.__dict__['_config']",
        "def f(engine):\n    return vars(engine)['_config']",
        "def f(engine):\n    return engine.__mangled",
        "import torch\ndef f(torch_like):\n    return torch_like._C",
    ],
)
def test_private_read_checker_catches_every_spelling(source):
    assert private_attribute_reads(source), f"not caught: {source!r}"


@pytest.mark.parametrize(
    "source",
    [
        "class A:\n    def f(self):\n        return self._x",
        "class A:\n    @classmethod\n    def f(cls):\n        return cls._registry",
        "import torch\nx = torch._utils",
        "import deepspeed.comm as dist\nx = dist._private",
        "def _helper():\n    pass\n_helper()",
        "def f(engine):\n    return engine.__class__.__name__",
        "def f(engine):\n    return getattr(engine, 'config', None)",
        "def f(scaler):\n    return getattr(scaler, '__dict__', None)",
        "def f(state):\n    return state['_key']",
    ],
)
def test_private_read_checker_allows_other_code(source):
    assert private_attribute_reads(source) == []


def test_the_checkpoint_package_reads_no_private_attribute():
    """deepspeed/checkpoint/ sees the engine and the ZeRO wrapper only through the state they declare
    (runtime/engine_state.py's CheckpointableEngine, runtime/zero/rank_state.py's ZeroStateOwner)."""
    files = sorted(CHECKPOINT.rglob("*.py"))
    assert files, f"no modules found under {CHECKPOINT}"
    violations = [f"{path.relative_to(PACKAGE.parent)}:{read}"
                  for path in files for read in private_attribute_reads(path.read_text(), str(path))]
    assert not violations, "private attributes read by deepspeed/checkpoint:\n" + "\n".join(violations)


def test_the_checkpoint_package_never_imports_the_engine():
    graph = import_graph()
    engine = {"deepspeed", "deepspeed.runtime.engine", "deepspeed.runtime.engine_setup"}
    assert {name: sorted(targets & engine) for name, targets in graph.items()
            if name.startswith("deepspeed.checkpoint") and targets & engine} == {}


# ------------------------------------------------------------------------------------------- Muon's three parts
MUON = "deepspeed.runtime.zero.muon"


def muon_part_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """What Muon's math imports from outside itself: only torch, the standard library and deepspeed's constants
    are allowed, and never the kernels, the executor or the optimizer. The kernels import neither the executor nor
    the optimizer."""
    forbidden = {f"{MUON}.math": (f"{MUON}.", ),
                 f"{MUON}.kernels": (f"{MUON}.executor", f"{MUON}.muon_optimizer", f"{MUON}.group_options")}
    allowed_inside = {f"{MUON}.math": (f"{MUON}.math", ), f"{MUON}.kernels": (f"{MUON}.kernels", f"{MUON}.math")}
    found = {}
    for name, targets in graph.items():
        for part, prefixes in forbidden.items():
            if name == part or name.startswith(part + "."):
                bad = sorted(t for t in targets if t.startswith(prefixes)
                             and not t.startswith(allowed_inside[part]) and t != MUON)
                if bad:
                    found[name] = bad
    return found


def test_muon_math_imports_neither_kernels_nor_executor():
    graph = import_graph()
    assert any(name.startswith(f"{MUON}.math.") for name in graph), "no module of Muon's math was found"
    assert muon_part_imports(graph) == {}


def test_the_muon_part_check_sees_a_math_module_importing_a_kernel():
    graph = {f"{MUON}.math.newton_schulz": {f"{MUON}.kernels.matrix_scale", f"{MUON}.math.ns_common"},
             f"{MUON}.kernels.fused_update": {f"{MUON}.kernels.fused_momentum", f"{MUON}.executor.step"}}
    assert muon_part_imports(graph) == {f"{MUON}.math.newton_schulz": [f"{MUON}.kernels.matrix_scale"],
                                        f"{MUON}.kernels.fused_update": [f"{MUON}.executor.step"]}
