"""Install the DeepSpeed Muon/ZeRO fork: `pip install -e .` or `pip install -e ".[dev]"`."""

import os
import subprocess

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def read_requirements(name):
    with open(os.path.join(HERE, "requirements", name)) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def git_info():
    try:
        git_hash = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=HERE,
                                           stderr=subprocess.DEVNULL).decode().strip()
        git_branch = subprocess.check_output(["git", "rev-parse", "--abbrev-ref", "HEAD"], cwd=HERE,
                                             stderr=subprocess.DEVNULL).decode().strip()
    except (OSError, subprocess.CalledProcessError):
        git_hash, git_branch = "[none]", "[none]"
    return git_hash, git_branch


with open(os.path.join(HERE, "version.txt")) as f:
    version = f.read().strip()

git_hash, git_branch = git_info()
# Installed metadata lets checkpoints record the real version even when run outside the checkout
# (upstream falls back to "0.0.0" there and then refuses its own ZeRO-1 checkpoints).
with open(os.path.join(HERE, "deepspeed", "git_version_info_installed.py"), "w") as f:
    f.write(f"version = {version!r}\ngit_hash = {git_hash!r}\ngit_branch = {git_branch!r}\n"
            "installed_ops = {}\n")

setup(
    name="deepspeed",
    version=version,
    description="DeepSpeed fork: Muon under ZeRO with fp16/bf16 and exact resume",
    long_description=open(os.path.join(HERE, "README.md")).read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["deepspeed", "deepspeed.*"]),
    package_data={"deepspeed": ["../version.txt"]},
    install_requires=read_requirements("requirements.txt"),
    extras_require={"dev": read_requirements("requirements-dev.txt")},
    entry_points={
        "console_scripts": [
            "deepspeed=deepspeed.launcher.runner:main",
            "ds_report=deepspeed.env_report:cli_main",
            "zero_to_fp32=deepspeed.utils.zero_to_fp32:main",
        ]
    },
)
