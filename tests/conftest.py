"""Session setup: import deepspeed from this checkout and run DistributedTest classes on their ranks."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

# No `import torch._dynamo` here: harness ranks get it from unit.common (imported once before the first fork) and
# python_process's server preloads it; a pytest process that runs no tests (xdist's controller, --collect-only)
# need not pay its 1.2 s of CPU.

os.environ.setdefault("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "python")


def _share_cores_among_xdist_workers() -> None:
    """Give each pytest-xdist worker its share of the cores: torch's default of one thread per core in every worker
    oversubscribes the machine, and OpenMP threads spinning at their barriers then cost several times the work
    (a bf16 Newton-Schulz test took 4x the CPU time with 2 threads in each of 2 workers on 2 cores)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if workers < 2:
        return
    threads = max(1, len(os.sched_getaffinity(0)) // workers)
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # processes the tests start


_share_cores_among_xdist_workers()
# The checkout's deepspeed wins over an installed one; sys.path[0] stays pytest's rootdir entry.
sys.path.insert(1, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from unit.torch_requirement import torch_requirement, torch_requirement_problem  # noqa: E402


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--torch_ver", default=None, type=str, help="torch version the run must use, e.g. 2.13")
    parser.addoption("--cuda_ver", default=None, type=str, help="CUDA version torch must be built with, e.g. 12.4")


def _same_version_prefix(expected: str, actual: str | None) -> bool:
    """Return True when `actual` starts with the release components given in `expected`."""
    from packaging import version

    if actual is None:
        return False
    want = version.parse(expected).release
    return version.parse(actual).release[: len(want)] == want


@pytest.fixture(scope="session", autouse=True)
def check_environment(pytestconfig: pytest.Config) -> None:
    """Stop the session when --torch_ver / --cuda_ver disagree with the torch in use.

    Without --torch_ver the torch in use is checked against the project's own requirement: a torch the project
    allows passes silently, one outside it is reported (the run goes on, as upstream's does without the option).
    """
    import torch

    checks = (
        ("torch", pytestconfig.getoption("torch_ver"), torch.__version__),
        ("cuda", pytestconfig.getoption("cuda_ver"), torch.version.cuda),
    )
    for name, expected, actual in checks:
        if expected is not None and not _same_version_prefix(expected, actual):
            pytest.exit(
                f"expected {name} version {expected} did not match found {name} version {actual}", returncode=2
            )
    problem = torch_requirement_problem(torch.__version__, torch_requirement())
    if pytestconfig.getoption("torch_ver") is None and problem is not None:
        warnings.warn(problem, stacklevel=2)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    """Run a DistributedTest method on its ranks instead of in this process."""
    if getattr(item.cls, "is_dist_test", False):
        item.cls()(item._request)
        item.runtest = lambda: None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop the rank pools that reuse_dist_env classes kept alive."""
    common = sys.modules.get("unit.common")
    if common is not None:
        common.DistributedExec.close_pools()
