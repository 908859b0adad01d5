"""Install the DeepSpeed Muon/ZeRO fork: `pip install -e .`, or `pip install -e ".[dev]"` for everything the tests use
(pytest, matplotlib, and transformers and accelerate, which the `hf` extra alone also installs).

Native ops are compiled just in time by default. To compile them at install instead, set `DS_BUILD_OPS=1` (every
op) or `DS_BUILD_<OP>=1` (one op, e.g. DS_BUILD_CPU_ADAM; it overrides DS_BUILD_OPS) and install without build
isolation, so that the build sees your torch: `DS_BUILD_CPU_ADAM=1 pip install --no-build-isolation .`
`DS_ENABLE_NINJA=1` compiles them with ninja (default: setuptools' compiler calls).
"""

import os
import subprocess
import sys

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from op_builder.all_ops import ALL_OPS  # noqa: E402 (the checkout's op_builder, before DeepSpeed is installed)


def read_requirements(name):
    """The requirements listed in requirements/NAME, following `-r OTHER` lines as pip does."""
    requirements = []
    with open(os.path.join(HERE, "requirements", name)) as f:
        for line in f:
            line = line.split("#")[0].strip()
            if line.startswith("-r "):
                requirements += read_requirements(line[len("-r "):].strip())
            elif line:
                requirements.append(line)
    return requirements


def git_info():
    try:
        git_hash = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=HERE,
                                           stderr=subprocess.DEVNULL).decode().strip()
        git_branch = subprocess.check_output(["git", "rev-parse", "--abbrev-ref", "HEAD"], cwd=HERE,
                                             stderr=subprocess.DEVNULL).decode().strip()
    except (OSError, subprocess.CalledProcessError):
        git_hash, git_branch = "[none]", "[none]"
    return git_hash, git_branch


def env_flag(name, default):
    value = os.environ.get(name)
    if value is None:
        return default
    if value not in ("0", "1"):
        sys.exit(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def ops_to_build():
    """{op name: True} for each op the DS_BUILD_* switches select (DS_BUILD_OPS, then each op's own switch)."""
    build_all = env_flag("DS_BUILD_OPS", False)
    selected = {name: env_flag(builder.BUILD_VAR, build_all) for name, builder in ALL_OPS.items()}
    print(f"DS_BUILD_OPS={int(build_all)}")
    return selected


def op_extensions(selected):
    """The setuptools extensions of the selected ops; exits naming what is missing when one cannot be built."""
    if not any(selected.values()):
        return [], {}
    try:
        import torch  # noqa: F401
    except ImportError:
        sys.exit("DS_BUILD_OPS / DS_BUILD_<OP> compile ops against the installed torch, which this build cannot "
                 "import: install torch first and run pip with --no-build-isolation")
    extensions = []
    for name, wanted in selected.items():
        if not wanted:
            continue
        builder = ALL_OPS[name]
        problems = builder.compatibility_problems()
        if problems:
            sys.exit(f"{builder.BUILD_VAR}=1 but the {name} op cannot be built here: " + "; ".join(problems))
        extensions.append(builder.builder())
    from torch.utils.cpp_extension import BuildExtension

    use_ninja = env_flag("DS_ENABLE_NINJA", False)
    return extensions, {"build_ext": BuildExtension.with_options(use_ninja=use_ninja)}


def torch_info():
    """The torch the ops are compiled against (checked when they are loaded); "0.0" fields without torch."""
    try:
        import torch
    except ImportError:
        return {"version": "0.0", "bf16_support": False, "cuda_version": "0.0", "nccl_version": "0.0",
                "hip_version": "0.0"}
    cuda = torch.version.cuda or "0.0"
    return {"version": ".".join(torch.__version__.split("+")[0].split(".")[:2]), "bf16_support": True,
            "cuda_version": ".".join(cuda.split(".")[:2]), "nccl_version": "0.0", "hip_version": "0.0"}


with open(os.path.join(HERE, "version.txt")) as f:
    version = f.read().strip()

git_hash, git_branch = git_info()
installed_ops = ops_to_build()
ext_modules, cmdclass = op_extensions(installed_ops)
print(f"Install Ops={installed_ops}")
print(f"version={version}, git_hash={git_hash}, git_branch={git_branch}")
# Installed metadata lets checkpoints record the real version even when run outside the checkout
# (upstream falls back to "0.0.0" there and then refuses its own ZeRO-1 checkpoints).
with open(os.path.join(HERE, "deepspeed", "git_version_info_installed.py"), "w") as f:
    f.write(f"version = {version!r}\ngit_hash = {git_hash!r}\ngit_branch = {git_branch!r}\n"
            f"installed_ops = {installed_ops!r}\n")
    if ext_modules:
        f.write(f"torch_info = {torch_info()!r}\n")

setup(
    name="deepspeed",
    version=version,
    description="DeepSpeed fork: Muon under ZeRO with fp16/bf16 and exact resume",
    long_description=open(os.path.join(HERE, "README.md")).read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["deepspeed", "deepspeed.*"]),
    package_data={"deepspeed": ["../version.txt"],
                  # The op sources, for JIT builds of an installed tree (deepspeed/ops/csrc links to csrc/).
                  "deepspeed.ops": ["csrc/*/*.cpp", "csrc/*/*.h"]},
    install_requires=read_requirements("requirements.txt"),
    extras_require={"dev": read_requirements("requirements-dev.txt"), "hf": read_requirements("requirements-hf.txt")},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={
        "console_scripts": [
            "deepspeed=deepspeed.launcher.runner:main",
            "ds_report=deepspeed.env_report:cli_main",
            "zero_to_fp32=deepspeed.utils.zero_to_fp32:main",
        ]
    },
)
