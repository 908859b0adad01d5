"""`OpBuilder`: what to compile for one native op, with which flags, whether this machine can, and how to load it.

An op is loaded from the module built at install time when there is one (`DS_BUILD_<OP>=1 pip install`), else
compiled just in time by `torch.utils.cpp_extension.load` with ninja into torch's extension cache
(`TORCH_EXTENSIONS_DIR`, else `~/.cache/torch_extensions/<python>_<device>/<op>`), where later processes find it
built. Failing to build is an `OpBuildError` naming the op, the command that failed and what to install; nothing
falls back to a slower path without saying so.

This module imports nothing of DeepSpeed (setup.py imports it from a source checkout) and imports torch only when
it builds or loads.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import time
from abc import ABC, abstractmethod
from types import ModuleType
from typing import Any, Iterator

# Where `csrc/` lies: next to the op_builder package (the repository root, or deepspeed/ops in an installed tree,
# where both are copied and deepspeed/ops/csrc is a link in the checkout).
OPS_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

COMPILER_ADVICE = ("install a C++ compiler with OpenMP, e.g. `apt-get install g++` (Debian/Ubuntu), "
                   "`dnf install gcc-c++` (Fedora/RHEL) or `conda install -c conda-forge cxx-compiler`, or point $CXX "
                   "at one")
PREBUILD_ADVICE = ("or install DeepSpeed with the op compiled ahead of time on a machine that can build it: "
                   "`{var}=1 pip install --no-build-isolation .`")


class OpBuildError(RuntimeError):
    """A native op could not be built or loaded. The message names the op, what failed and what to install."""


def _cpu_info() -> dict[str, Any]:
    """py-cpuinfo's facts (arch, flags), else lscpu's; {} when neither answers."""
    try:
        from cpuinfo import get_cpu_info

        info = get_cpu_info()
        return {"arch": info.get("arch", ""), "flags": set(info.get("flags", [])),
                "vendor": info.get("vendor_id_raw", "")}
    except Exception:  # py-cpuinfo missing or failing on this platform: lscpu below
        pass
    try:
        output = subprocess.check_output(["lscpu"], text=True, stderr=subprocess.DEVNULL)
    except (OSError, subprocess.CalledProcessError):
        return {}
    fields = dict(line.split(":", 1) for line in output.splitlines() if ":" in line)
    return {"arch": fields.get("Architecture", "").strip().upper().replace("AARCH64", "ARM_8"),
            "flags": set(fields.get("Flags", "").split()), "vendor": fields.get("Vendor ID", "").strip()}


@functools.cache
def cpu_info() -> dict[str, Any]:
    """This CPU's architecture and feature flags (asked once per process: py-cpuinfo takes about a second)."""
    return _cpu_info()


def simd_define(info: dict[str, Any] | None = None) -> str:
    """The widest SIMD path csrc/includes/simd.h can compile for this CPU, as a -D flag.

    AVX-512 needs avx512f; AVX2 needs avx2, fma and f16c; Arm (aarch64) has NEON; anything else is scalar.
    """
    info = cpu_info() if info is None else info
    flags = info.get("flags", set())
    arch = str(info.get("arch", "")).upper()
    machine = platform.machine().lower()
    if arch.startswith("ARM_8") or machine in ("aarch64", "arm64"):
        return "-D__NEON__"
    if arch.startswith("X86") or machine in ("x86_64", "amd64"):
        if "avx512f" in flags:
            return "-D__AVX512__"
        if {"avx2", "fma", "f16c"} <= flags:
            return "-D__AVX256__"
    return "-D__SCALAR__"


def cpu_arch_flag() -> str:
    """Tune for the building CPU (-march=native; PowerPC -mcpu=native; RISC-V the rv64gc baseline)."""
    machine = platform.machine().lower()
    if machine.startswith("ppc"):
        return "-mcpu=native"
    if machine.startswith("riscv"):
        return "-march=rv64gc"
    return "-march=native"


def failed_command(build_output: str) -> str | None:
    """The command ninja reports as failed ("FAILED: target" then the command line), if any."""
    lines = build_output.splitlines()
    for index, line in enumerate(lines):
        if line.startswith("FAILED:") and index + 1 < len(lines):
            return lines[index + 1].strip()
    return None


class OpBuilder(ABC):
    """One native op: its sources, include paths and flags, whether this machine can build it, and loading it.

    Subclasses set `BUILD_VAR` (the environment switch that pre-builds it at install, e.g. DS_BUILD_CPU_ADAM) and
    `NAME`, and define `absolute_name()`, `sources()`, and where needed `include_paths()`, `cxx_args()`,
    `extra_ldflags()`. Loaded modules are cached per process in `OpBuilder._loaded_ops`.
    """

    BUILD_VAR = ""
    NAME = ""
    _loaded_ops: dict[str, ModuleType] = {}

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.NAME

    # ------------------------------------------------------------------ what to compile
    @abstractmethod
    def absolute_name(self) -> str:
        """Import path of the module when built at install (e.g. deepspeed.ops.adam.cpu_adam_op)."""

    @abstractmethod
    def sources(self) -> list[str]:
        """Source files, relative to the directory that holds csrc/."""

    def include_paths(self) -> list[str]:
        """Include directories, relative to the directory that holds csrc/."""
        return []

    def cxx_args(self) -> list[str]:
        """Compiler flags (torch adds its own: -fPIC, the C++ standard, its include paths and ABI macros)."""
        return ["-O3"]

    def extra_ldflags(self) -> list[str]:
        return []

    def cpu_arch(self) -> str:
        return cpu_arch_flag()

    def simd_width(self) -> str:
        return simd_define()

    @staticmethod
    def absolute_path(relative: str) -> str:
        return os.path.join(OPS_ROOT, relative)

    # ------------------------------------------------------------------ can this machine build it
    def compatibility_problems(self) -> list[str]:
        """What stops a JIT build here, each with what to install; [] when nothing does."""
        problems = []
        if sys.platform == "win32":
            problems.append("building native ops on Windows is not supported by this fork")
        compiler = os.environ.get("CXX", "c++")
        if shutil.which(compiler) is None:
            problems.append(f"no C++ compiler: `{compiler}` is not on PATH; {COMPILER_ADVICE}")
        python_h = os.path.join(sysconfig.get_paths()["include"], "Python.h")
        if not os.path.isfile(python_h):
            version = f"{sys.version_info.major}.{sys.version_info.minor}"
            problems.append(f"Python's C headers are missing ({python_h}); install them, e.g. `apt-get install "
                            f"python{version}-dev` or `dnf install python{version}-devel`")
        missing = [path for path in self.sources() if not os.path.isfile(self.absolute_path(path))]
        if missing:
            problems.append(f"sources {missing} are missing under {OPS_ROOT}; reinstall DeepSpeed")
        return problems

    def is_compatible(self, verbose: bool = False) -> bool:
        """True when this machine can JIT-build the op (or it was built at install)."""
        if self.is_installed():
            return True
        problems = self.compatibility_problems()
        if verbose and problems:
            print(f"{self.name}: " + "; ".join(problems))
        return not problems

    def is_installed(self) -> bool:
        """True when the op was compiled at install time (setup.py recorded it in installed_ops)."""
        try:
            from deepspeed.git_version_info import installed_ops
        except ImportError:
            return False
        return bool(installed_ops.get(self.name, False))

    # ------------------------------------------------------------------ loading
    def load(self, verbose: bool = False) -> ModuleType:
        """The op's module: cached, else the one built at install, else built just in time.

        Raises:
            OpBuildError: it cannot be built or imported here (the message says why and what to install).
        """
        if self.name in OpBuilder._loaded_ops:
            return OpBuilder._loaded_ops[self.name]
        module = self._load_installed() if self.is_installed() else self.jit_load(verbose)
        OpBuilder._loaded_ops[self.name] = module
        return module

    def _load_installed(self) -> ModuleType:
        import torch

        from deepspeed.git_version_info import torch_info

        current = ".".join(torch.__version__.split("+")[0].split(".")[:2])
        if torch_info.get("version") not in (None, current):
            raise OpBuildError(
                "PyTorch version mismatch! DeepSpeed ops were compiled and installed with a different version than "
                f"what is being used at runtime ({self.name}: built with torch {torch_info['version']}, running "
                f"torch {current}). Please re-install DeepSpeed or switch torch versions.")
        try:
            return importlib.import_module(self.absolute_name())
        except ImportError as error:
            raise OpBuildError(f"the {self.name} op was built at install but cannot be imported ({error}); "
                               f"reinstall DeepSpeed with {self.BUILD_VAR}=1 for this torch") from error

    def jit_load(self, verbose: bool = False) -> ModuleType:
        """Compile the op with torch.utils.cpp_extension and ninja into torch's extension cache, then import it.

        Concurrent processes (pytest-xdist workers, ranks) build it once: torch serialises builds of one op with a
        lock file in its build directory and skips an up-to-date build; a file lock of ours around that clears a
        lock file left behind by a process killed mid-build, which would otherwise make every later load wait.

        Raises:
            OpBuildError: incompatible machine, no ninja, a failed compile or link, or an import failure.
        """
        problems = self.compatibility_problems()
        if problems:
            raise OpBuildError(f"Unable to JIT load the {self.name} op due to it not being compatible due to "
                               f"hardware/software issue: " + "; ".join(problems))
        from torch.utils import cpp_extension

        if not cpp_extension.is_ninja_available():
            raise OpBuildError(f"Unable to JIT load the {self.name} op due to ninja not being installed. Install it "
                               "with `pip install ninja` (DeepSpeed's requirements list it).")
        start = time.time()
        files = _source_files(self)
        build_directory = self.jit_build_directory()
        with _exclusive(build_directory):
            staged = _stage_sources(files, os.path.join(build_directory, "src"))
            try:
                module = cpp_extension.load(
                    name=self.name,
                    sources=[os.path.join(staged, _staged_name(path)) for path in self.sources()],
                    extra_include_paths=[os.path.join(staged, _staged_name(path)) for path in self.include_paths()],
                    extra_cflags=self.cxx_args(),
                    extra_ldflags=self.extra_ldflags(),
                    build_directory=build_directory,
                    verbose=verbose,
                )
            except (RuntimeError, subprocess.CalledProcessError, OSError) as error:
                raise self._build_error(error, build_directory) from error
            except ImportError as error:
                raise OpBuildError(f"the {self.name} op was built in {build_directory} but cannot be imported: "
                                   f"{error}. Delete that directory to rebuild it.") from error
        if verbose:
            print(f"Time to load {self.name} op: {time.time() - start} seconds")
        return module

    def jit_build_directory(self) -> str:
        """Where `jit_load` builds this op: `<extension root>/<name>/<digest of the sources, flags and torch>`
        (the root is `TORCH_EXTENSIONS_DIR`, else torch's default). Created if missing."""
        from torch.utils import cpp_extension

        files = _source_files(self)
        return _build_directory(cpp_extension, self.name, _build_key(files, self.cxx_args() + self.extra_ldflags()))

    def _build_error(self, error: BaseException, build_directory: str) -> OpBuildError:
        output = str(error)
        command = failed_command(output)
        compiler_output = output.split("\n", 1)[1] if "\n" in output else output
        tail = "\n".join(f"    {line}" for line in compiler_output.strip().splitlines()[-25:])
        return OpBuildError(
            f"Building the {self.name} op failed (torch.utils.cpp_extension with ninja, in {build_directory}).\n"
            f"  command that failed: {command or '(ninja did not name one; see the output below)'}\n"
            f"  output:\n{tail}\n"
            f"  To build it: {COMPILER_ADVICE}; Python's C headers (`apt-get install python3-dev`); torch with its "
            f"C++ headers; ninja (`pip install ninja`); {PREBUILD_ADVICE.format(var=self.BUILD_VAR)}")

    # ------------------------------------------------------------------ install-time builds (setup.py)
    def builder(self):
        """A setuptools extension that compiles this op at install (`DS_BUILD_OPS=1` or its `BUILD_VAR`)."""
        from torch.utils.cpp_extension import CppExtension

        return CppExtension(name=self.absolute_name(),
                            sources=[os.path.relpath(self.absolute_path(path)) for path in self.sources()],
                            include_dirs=[self.absolute_path(path) for path in self.include_paths()],
                            extra_compile_args={"cxx": self.cxx_args()},
                            extra_link_args=self.extra_ldflags())


def _staged_name(path: str) -> str:
    """Where a source or include directory goes in the staged copy: its path relative to the directory that holds
    csrc/ (an absolute path outside it keeps its whole path below the copy's root)."""
    return path.lstrip(os.sep) if os.path.isabs(path) else path


def _source_files(builder: OpBuilder) -> dict[str, bytes]:
    """Every file the build reads from csrc/: the sources and everything under the include directories, by their
    staged name."""
    files = {}
    for relative in builder.sources():
        with open(builder.absolute_path(relative), "rb") as handle:
            files[_staged_name(relative)] = handle.read()
    for include in builder.include_paths():
        top = builder.absolute_path(include)
        for folder, _, names in os.walk(top):
            for name in names:
                path = os.path.join(folder, name)
                with open(path, "rb") as handle:
                    files[os.path.join(_staged_name(include), os.path.relpath(path, top))] = handle.read()
    return files


def _build_key(files: dict[str, bytes], flags: list[str]) -> str:
    """A digest of what the build reads (file contents, flags, torch): one build per distinct op, shared by every
    checkout and virtual environment that has the same sources, and never one checkout's build for another's."""
    import torch

    digest = hashlib.sha256(f"{torch.__version__}\0{sys.version_info[:2]}\0{' '.join(flags)}".encode())
    for relative in sorted(files):
        digest.update(relative.encode() + b"\0" + hashlib.sha256(files[relative]).digest())
    return digest.hexdigest()[:16]


def _stage_sources(files: dict[str, bytes], root: str) -> str:
    """Write the sources under `root` (unchanged files are left alone, so their times and ninja's view hold); torch
    then compiles from paths that are the same in every checkout, and ninja finds an earlier build up to date."""
    for relative, content in files.items():
        path = os.path.join(root, relative)
        try:
            with open(path, "rb") as handle:
                if handle.read() == content:
                    continue
        except FileNotFoundError:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as handle:
            handle.write(content)
    return root


def _build_directory(cpp_extension: ModuleType, name: str, key: str) -> str:
    """The build directory of this op's sources (created if missing), in torch's extension root
    (`TORCH_EXTENSIONS_DIR`, else torch's default): `<root>/<name>/<key>`, where torch's own lock file lives."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    path = os.path.join(root, name, key)
    os.makedirs(path, exist_ok=True)
    return path


@contextlib.contextmanager
def _exclusive(build_directory: str) -> Iterator[None]:
    """Hold an flock on the build directory; while held, torch's `lock` file can only be a dead process's."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own lock alone
        yield
        return
    with open(os.path.join(build_directory, ".deepspeed_build_lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        stale = os.path.join(build_directory, "lock")
        if os.path.exists(stale):
            print(f"[deepspeed] removing {stale}, left by a build that did not finish", file=sys.stderr)
            with contextlib.suppress(FileNotFoundError):
                os.remove(stale)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)

