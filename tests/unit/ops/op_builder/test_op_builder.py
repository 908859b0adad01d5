"""op_builder: SIMD flags from the CPU's features, what the accelerators find, and the errors of builds that cannot
happen or fail (each names the op, the failed command and what to install; nothing falls back silently).

The builds here are of tiny C sources into a temporary TORCH_EXTENSIONS_DIR, so they take about a second.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import deepspeed
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
from deepspeed.ops.op_builder import CPUAdamBuilder, OpBuildError, OpBuilder
from deepspeed.ops.op_builder.all_ops import ALL_OPS
from deepspeed.ops.op_builder.builder import failed_command, simd_define

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))))

# A Python module in C, named by torch's TORCH_EXTENSION_NAME macro (so it also loads under a versioned name).
TINY_SOURCE = textwrap.dedent("""
    #include <Python.h>
    #define DS_STR2(x) #x
    #define DS_STR(x) DS_STR2(x)
    #define DS_CAT2(a, b) a##b
    #define DS_CAT(a, b) DS_CAT2(a, b)
    static struct PyModuleDef tiny = {PyModuleDef_HEAD_INIT, DS_STR(TORCH_EXTENSION_NAME), NULL, -1, NULL};
    PyMODINIT_FUNC DS_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&tiny); }
    """)


def tiny_builder(source_path, name):
    class TinyBuilder(OpBuilder):
        BUILD_VAR = "DS_BUILD_TINY"
        NAME = name

        def absolute_name(self):
            return f"deepspeed.ops.{name}_op"

        def sources(self):
            return [str(source_path)]  # absolute: os.path.join keeps it as it is

    return TinyBuilder()


@pytest.fixture
def extensions_dir(tmp_path, monkeypatch):
    directory = tmp_path / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(directory))
    yield directory
    for name in [n for n in OpBuilder._loaded_ops if n.startswith("ds_test_")]:
        del OpBuilder._loaded_ops[name]


@pytest.mark.parametrize("info, define", [
    ({"arch": "X86_64", "flags": {"avx512f", "avx2", "fma", "f16c"}}, "-D__AVX512__"),
    ({"arch": "X86_64", "flags": {"avx2", "fma", "f16c"}}, "-D__AVX256__"),
    ({"arch": "X86_64", "flags": {"avx2"}}, "-D__SCALAR__"),
    ({"arch": "X86_64", "flags": {"sse4_2"}}, "-D__SCALAR__"),
    ({"arch": "ARM_8", "flags": {"asimd"}}, "-D__NEON__"),
])
def test_simd_define_follows_the_cpu_flags(info, define, monkeypatch):
    monkeypatch.setattr("platform.machine", lambda: "aarch64" if info["arch"] == "ARM_8" else "x86_64")
    assert simd_define(info) == define


def test_cpu_adam_builder_names_and_flags():
    builder = CPUAdamBuilder()
    assert (builder.NAME, builder.BUILD_VAR, builder.absolute_name()) == ("cpu_adam", "DS_BUILD_CPU_ADAM",
                                                                          "deepspeed.ops.adam.cpu_adam_op")
    assert builder.sources() == ["csrc/adam/cpu_adam.cpp"]
    assert all(os.path.isfile(builder.absolute_path(path)) for path in builder.sources())
    assert os.path.isfile(os.path.join(builder.absolute_path(builder.include_paths()[0]), "cpu_adam.h"))
    args = builder.cxx_args()
    assert "-O3" in args and "-fopenmp" in args and "-ffp-contract=off" in args
    assert builder.simd_width() in args and builder.cpu_arch() in args
    assert ALL_OPS == {"cpu_adam": ALL_OPS["cpu_adam"]} and isinstance(ALL_OPS["cpu_adam"], CPUAdamBuilder)
    assert deepspeed.ops.op_builder.CPUAdamBuilder is CPUAdamBuilder
    assert deepspeed.ops.__compatible_ops__ == {"cpu_adam": builder.is_compatible()}


@pytest.mark.parametrize("accelerator", [CPU_Accelerator, CUDA_Accelerator])
def test_both_accelerators_find_the_cpu_adam_builder(accelerator):
    instance = accelerator.__new__(accelerator)  # op_builder_dir needs no device
    assert instance.get_op_builder("CPUAdamBuilder").NAME == "cpu_adam"
    assert instance.create_op_builder("CPUAdamBuilder").NAME == "cpu_adam"
    assert instance.get_op_builder("FusedAdamBuilder") is None and instance.create_op_builder("NoSuchBuilder") is None


def test_failed_command_is_the_line_after_ninjas_failed():
    output = ("Error building extension 'x': [1/2] c++ -c a.cpp -o a.o\nFAILED: a.o \nc++ -MMD -c /src/a.cpp -o a.o\n"
              "/src/a.cpp:1:1: error: expected\nninja: build stopped: subcommand failed.\n")
    assert failed_command(output) == "c++ -MMD -c /src/a.cpp -o a.o"
    assert failed_command("no ninja output") is None


def test_a_source_that_does_not_compile_names_the_op_the_command_and_what_to_install(tmp_path, extensions_dir):
    source = tmp_path / "broken.cpp"
    source.write_text("this is not C++;\n")
    builder = tiny_builder(source, "ds_test_broken")
    with pytest.raises(OpBuildError) as info:
        builder.load()
    message = str(info.value)
    assert "Building the ds_test_broken op failed" in message
    command = message.split("command that failed: ", 1)[1].splitlines()[0]
    assert str(source) in command and " -c " in command
    assert "error" in message  # the compiler's own words
    assert "apt-get install g++" in message and "pip install ninja" in message
    assert "DS_BUILD_TINY=1 pip install --no-build-isolation" in message
    assert "ds_test_broken" not in OpBuilder._loaded_ops


def test_no_compiler_is_refused_before_building_saying_what_to_install(monkeypatch, tmp_path, extensions_dir):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    builder = tiny_builder(tmp_path / "unused.cpp", "ds_test_no_compiler")
    (tmp_path / "unused.cpp").write_text(TINY_SOURCE)
    assert not builder.is_compatible()
    with pytest.raises(OpBuildError) as info:
        builder.load()
    message = str(info.value)
    assert "Unable to JIT load the ds_test_no_compiler op" in message
    assert "no C++ compiler: `/nonexistent/c++` is not on PATH" in message and "apt-get install g++" in message
    assert not extensions_dir.exists() or not any(extensions_dir.iterdir()), "nothing was built"
    assert not CPUAdamBuilder().is_compatible() or CPUAdamBuilder().is_installed()


def test_no_ninja_is_refused_saying_what_to_install(monkeypatch, tmp_path, extensions_dir):
    import torch.utils.cpp_extension

    (tmp_path / "tiny.cpp").write_text(TINY_SOURCE)
    monkeypatch.setattr(torch.utils.cpp_extension, "is_ninja_available", lambda: False)
    with pytest.raises(OpBuildError, match=r"ds_test_no_ninja op due to ninja not being installed\. Install it with "
                       r"`pip install ninja`"):
        tiny_builder(tmp_path / "tiny.cpp", "ds_test_no_ninja").load()


def test_missing_sources_are_incompatible(tmp_path):
    builder = tiny_builder(tmp_path / "absent.cpp", "ds_test_absent")
    problems = builder.compatibility_problems()
    assert any("are missing" in problem and "absent.cpp" in problem for problem in problems)


def test_concurrent_builds_share_one_build_and_a_dead_builds_lock_is_cleared(tmp_path, extensions_dir):
    """Two processes load the same op at once into an empty cache holding a lock file that a killed build left:
    both get the module (torch would wait on that lock forever)."""
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY_SOURCE)
    name = "ds_test_concurrent"
    build_directory = Path(tiny_builder(source, name).jit_build_directory())
    assert build_directory.parent == extensions_dir / name
    (build_directory / "lock").write_text("")
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {REPO_ROOT!r})
        from op_builder.builder import OpBuilder

        class Tiny(OpBuilder):
            NAME = {name!r}
            def absolute_name(self): return "unused"
            def sources(self): return [{str(source)!r}]

        module = Tiny().load()
        print("loaded", module.__name__)
        """)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions_dir)}
    processes = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [process.communicate(timeout=240)[0] for process in processes]
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output
        assert f"loaded {name}" in output, output
    assert sum("left by a build that did not finish" in output for output in outputs) == 1
    assert not (build_directory / "lock").exists()


def checkout_builder(root, name):
    """A builder whose csrc/ lives under `root`, as the ops of one checkout of the repository do."""
    class CheckoutBuilder(OpBuilder):
        NAME = name

        def absolute_name(self):
            return f"deepspeed.ops.{name}_op"

        def sources(self):
            return ["csrc/tiny/tiny.cpp"]

        def include_paths(self):
            return ["csrc/includes"]

        @staticmethod
        def absolute_path(relative):
            return os.path.join(str(root), relative)

    return CheckoutBuilder()


def test_checkouts_with_the_same_sources_share_one_build_and_a_changed_source_gets_its_own(tmp_path, extensions_dir):
    for checkout in ("one", "two", "three"):
        (tmp_path / checkout / "csrc" / "tiny").mkdir(parents=True)
        (tmp_path / checkout / "csrc" / "includes").mkdir(parents=True)
        (tmp_path / checkout / "csrc" / "tiny" / "tiny.cpp").write_text(TINY_SOURCE)
        (tmp_path / checkout / "csrc" / "includes" / "tiny.h").write_text("#define TINY 1\n")
    (tmp_path / "three" / "csrc" / "includes" / "tiny.h").write_text("#define TINY 2\n")
    name = "ds_test_checkouts"
    one, two, three = (checkout_builder(tmp_path / c, name) for c in ("one", "two", "three"))

    assert one.load().__name__ == name
    built = Path(one.jit_build_directory()) / f"{name}.so"
    first_build = built.stat().st_mtime_ns
    assert two.jit_build_directory() == one.jit_build_directory()
    OpBuilder._loaded_ops.pop(name)
    assert two.load().__name__ == name
    assert built.stat().st_mtime_ns == first_build, "the second checkout rebuilt an up-to-date op"
    assert three.jit_build_directory() != one.jit_build_directory(), "a changed header must get its own build"
    OpBuilder._loaded_ops.pop(name)


def test_an_op_built_at_install_is_loaded_only_with_the_torch_it_was_built_for(monkeypatch, tmp_path):
    import deepspeed.git_version_info

    builder = tiny_builder(tmp_path / "tiny.cpp", "ds_test_installed")
    monkeypatch.setattr(type(builder), "is_installed", lambda self: True)
    monkeypatch.setattr(deepspeed.git_version_info, "torch_info", {"version": "1.0"})
    with pytest.raises(OpBuildError, match=r"PyTorch version mismatch! .* \(ds_test_installed: built with torch 1\.0"):
        builder.load()
    import torch

    monkeypatch.setattr(deepspeed.git_version_info, "torch_info",
                        {"version": ".".join(torch.__version__.split("+")[0].split(".")[:2])})
    with pytest.raises(OpBuildError, match=r"built at install but cannot be imported .* DS_BUILD_TINY=1"):
        builder.load()
