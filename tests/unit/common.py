"""Distributed unit tests: `DistributedTest` classes run each test method on several ranks.

On CUDA every rank gets its own GPU and NCCL; without GPUs the CPU accelerator and gloo run the same
tests for real. A test that runs past `exec_timeout` fails (its ranks are terminated); it never stalls
the rest of the session.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import multiprocessing as mp
import os
import random
import socket
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Self

import pytest
import torch

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator

from .dist_launcher import RankSpec, WorkerPool, failure_message, launch_one_shot, reap_leaving, skip_message

DEEPSPEED_TEST_TIMEOUT = int(os.environ.get("DS_UNITTEST_TIMEOUT") or 600)
# Pools of ranks kept alive per pytest worker (one per world size and backend), most recently used first.
MAX_POOLS = 2


def get_xdist_worker_id() -> int | None:
    """Return N for pytest-xdist worker 'gwN', or None outside xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return int(worker.replace("gw", "")) if worker else None


def get_master_port(base_port: int = 29500, port_range_size: int = 1000) -> int:
    """Return a bindable port; each xdist worker searches its own range so parallel workers never collide.

    Raises:
        IOError: when no port in the range can be bound.
    """
    worker_id = get_xdist_worker_id()
    if worker_id is not None:
        base_port += port_range_size * worker_id
    for port in range(base_port, base_port + port_range_size):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    raise OSError("no free ports")


def _is_cpu_accelerator() -> bool:
    return get_accelerator().device_name() == "cpu"


def _visible_devices_for_worker() -> str | None:
    """Return CUDA_VISIBLE_DEVICES rotated by the xdist worker index, so parallel workers start on different GPUs."""
    if _is_cpu_accelerator() or "CUDA_VISIBLE_DEVICES" in os.environ:
        return None
    ids = list(range(get_accelerator().device_count()))
    shift = (get_xdist_worker_id() or 0) % max(1, len(ids))
    return ",".join(str(i) for i in ids[shift:] + ids[:shift])


def _start_method() -> str:
    """Return 'fork' on the CPU accelerator (cheap, and the parent holds no CUDA context), else 'forkserver'."""
    available = mp.get_all_start_methods()
    preferred = ["fork", "forkserver", "spawn"] if _is_cpu_accelerator() else ["forkserver", "spawn"]
    return next(method for method in preferred if method in available)


@functools.cache
def _answer_before_forking() -> None:
    """Do once in this process what every rank would otherwise do again after each fork.

    py-cpuinfo answers what the CPU's features are in a subprocess of its own (about a second of CPU); ranks forked
    after this inherit the cached answer, so each offload or cpu_adam test no longer pays it on every rank. The first
    torch optimizer a process builds imports torch._dynamo (`Optimizer.add_param_group` is wrapped by
    `torch._disable_dynamo`), about 2 s of CPU, which every rank of a test that builds an engine would pay; and
    `import deepspeed` loads the engine's modules only on first use of `deepspeed.initialize` and the rest.
    """
    import torch._dynamo  # noqa: F401

    import deepspeed.public_api  # noqa: F401
    try:
        from deepspeed.ops.op_builder.builder import cpu_info
    except ImportError:
        return
    cpu_info()


class DistributedExec:
    """Runs `self.run(**kwargs)` on `world_size` ranks with an initialised process group.

    Class attributes: world_size (int or list of ints), backend, init_distributed, set_dist_env,
    requires_cuda_env, reuse_dist_env (keep ranks alive between tests: True, False, or None for this harness's
    default, which keeps them on CPU ranks and starts fresh ones on accelerators), exec_timeout (seconds).
    """

    world_size: int | list[int] | tuple[int, ...] = 2
    backend: str = get_accelerator().communication_backend_name()
    init_distributed: bool = True
    set_dist_env: bool = True
    requires_cuda_env: bool = True
    reuse_dist_env: bool | None = None
    exec_timeout: float = DEEPSPEED_TEST_TIMEOUT
    _pool_cache: ClassVar[dict[tuple[Any, ...], WorkerPool]] = {}

    def run(self, **kwargs: Any) -> None:
        """Body executed on every rank."""
        raise NotImplementedError("DistributedExec subclasses implement run()")

    def _skip_reason(self, num_procs: int) -> str | None:
        accelerator = get_accelerator()
        if self.requires_cuda_env and not accelerator.is_available():
            return "only supported in accelerator environments."
        # CPU ranks share the host, so any number of them fit; devices are one per rank.
        if not _is_cpu_accelerator() and accelerator.device_count() < num_procs:
            return (
                f"Skipping test because not enough GPUs are available: {num_procs} required, "
                f"{accelerator.device_count()} available"
            )
        return None

    def _rank_spec(self, num_procs: int) -> RankSpec:
        init_file = os.path.join(tempfile.gettempdir(), f"ds_test_{uuid.uuid4().hex}_filestore")
        return RankSpec(
            world_size=num_procs,
            backend=self.backend,
            init_method=f"file://{init_file}",
            master_port=get_master_port(),
            init_distributed=self.init_distributed,
            set_dist_env=self.set_dist_env,
            set_device=not _is_cpu_accelerator(),
            num_threads=1 if _is_cpu_accelerator() else None,
            visible_devices=_visible_devices_for_worker(),
        )

    def _uses_pool(self) -> bool:
        reuse = self.reuse_dist_env
        if reuse is None:
            # CPU ranks: a fresh launch per test (fork, rendezvous, gloo, teardown) cost more than many tests' bodies
            # on the 2-core CI machine. Pooled ranks restore what a test may change between tasks (`_pool_main`);
            # a class that changes more (the process group itself, say) sets reuse_dist_env = False.
            reuse = _is_cpu_accelerator()
        return (
            reuse
            and self.init_distributed
            and self.set_dist_env
            and os.environ.get("DS_DISABLE_REUSE_DIST_ENV") != "1"
        )

    def _pool_for(self, ctx: Any, num_procs: int, start_method: str) -> WorkerPool:
        key = (num_procs, self.backend, start_method)
        pool = DistributedExec._pool_cache.pop(key, None)
        if pool is not None and not pool.is_alive():
            pool.close(graceful=False)
            pool = None
        if pool is None:
            # Idle ranks hold memory: keep the most recently used pools only.
            while len(DistributedExec._pool_cache) >= MAX_POOLS:
                DistributedExec._pool_cache.pop(next(iter(DistributedExec._pool_cache))).close()
            pool = WorkerPool(ctx, self._rank_spec(num_procs))
        DistributedExec._pool_cache[key] = pool  # last in the dict: the most recently used
        return pool

    def _launch_procs(self, num_procs: int, method_name: str = "run", kwargs: dict[str, Any] | None = None) -> None:
        """Run `method_name(**kwargs)` on `num_procs` ranks; fail or skip the current test as they did.

        Raises:
            pytest.fail.Exception: a rank raised, crashed or outlived `exec_timeout`.
            pytest.skip.Exception: the environment cannot host the ranks, or the ranks skipped.
        """
        reason = self._skip_reason(num_procs)
        if reason is not None:
            pytest.skip(reason)
        start_method = _start_method()
        if start_method == "fork":
            _answer_before_forking()
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            # Ranks fork from a server that has already paid for importing torch and deepspeed.
            ctx.set_forkserver_preload(["torch", "deepspeed.public_api"])
        task = (self, method_name, kwargs or {})
        if self._uses_pool():
            outcome = self._pool_for(ctx, num_procs, start_method).run(task, self.exec_timeout)
        else:
            outcome = launch_one_shot(ctx, self._rank_spec(num_procs), task, self.exec_timeout)
        message = failure_message(outcome, self.exec_timeout)
        if message is not None:
            pytest.fail(message, pytrace=False)
        skipped = skip_message(outcome)
        if skipped is not None:
            pytest.skip(skipped)

    @classmethod
    def close_pools(cls) -> None:
        """Stop every cached pool of ranks and join the ranks of passed launches still leaving (end of session)."""
        reap_leaving(wait=True)
        while DistributedExec._pool_cache:
            _, pool = DistributedExec._pool_cache.popitem()
            pool.close()


# Pool ranks are non-daemonic (tests may start processes of their own), and multiprocessing joins such
# children at exit: stop them first. Registered after multiprocessing's own hook, so it runs before it.
atexit.register(DistributedExec.close_pools)


def _fixture_kwargs(request: pytest.FixtureRequest, func: Callable[..., Any]) -> dict[str, Any]:
    """Return the values pytest prepared for `func`'s parameters; others keep their defaults."""
    names = [name for name in inspect.signature(func).parameters if name != "self"]
    return {name: request.getfixturevalue(name) for name in names if name in request.fixturenames}


class DistributedTest(DistributedExec):
    """Base of test classes whose methods run on `world_size` ranks (see tests/conftest.py).

    The world size of a method comes from @pytest.mark.world_size(n), else a fixture or parameter named
    `world_size`, else the class attribute; a list runs the method once per size.
    """

    is_dist_test = True

    @pytest.fixture(autouse=True, scope="class")
    @classmethod
    def class_tmpdir(cls, tmpdir_factory: Any) -> Any:
        """Directory shared by the tests of one class (and the distributed fixtures they use)."""
        return tmpdir_factory.mktemp(cls.__name__)

    def run(self, **kwargs: Any) -> None:
        """Not used: DistributedTest runs the current test method instead."""
        raise NotImplementedError("DistributedTest runs its test methods, not run()")

    def _world_sizes(self, request: pytest.FixtureRequest) -> list[int]:
        marker = request.node.get_closest_marker("world_size")
        if marker is not None:
            world_size = marker.args[0]
        elif "world_size" in request.fixturenames:
            world_size = request.getfixturevalue("world_size")
        else:
            world_size = self.world_size
        return list(world_size) if isinstance(world_size, (list, tuple)) else [world_size]

    def __call__(self, request: pytest.FixtureRequest) -> None:
        """Run the test method that `request` belongs to on each of its world sizes.

        Raises:
            ValueError: the class name does not start with 'Test'.
        """
        if not type(self).__name__.startswith("Test"):
            raise ValueError(f"DistributedTest class names must start with 'Test', got {type(self).__name__}")
        method_name = request.function.__name__
        kwargs = _fixture_kwargs(request, getattr(self, method_name))
        for num_procs in self._world_sizes(request):
            self._launch_procs(num_procs, method_name, kwargs)


class DistributedFixture(DistributedExec):
    """A fixture whose `run(...)` executes on `world_size` ranks before the test that names it.

    Subclass it at module level, implement `run(self, <fixtures>)`, and name the class as a test
    argument. Results travel through files (e.g. `class_tmpdir`); the fixture value itself is None.
    Each subclass is registered as an ordinary pytest fixture when it is defined, so pytest sets up the
    fixtures `run` needs first.
    """

    is_dist_fixture = True
    world_size: int = 2

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not isinstance(cls.world_size, int):
            raise TypeError(f"{cls.__name__}.world_size must be a single int, got {cls.world_size!r}")
        module = sys.modules.get(cls.__module__)
        if module is not None:
            setattr(module, f"_{cls.__name__}_dist_fixture", _as_pytest_fixture(cls))

    def __call__(self, request: pytest.FixtureRequest) -> None:
        """Run `run` on the ranks with the fixture values pytest prepared."""
        self._launch_procs(self.world_size, "run", _fixture_kwargs(request, self.run))


def _as_pytest_fixture(cls: type[DistributedFixture]) -> Any:
    """Return a pytest fixture named after `cls` that depends on `cls.run`'s fixtures and launches it."""

    def launch(request: pytest.FixtureRequest, **_: Any) -> None:
        cls()(request)

    params = [inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [p for name, p in inspect.signature(cls.run).parameters.items() if name not in ("self", "request")]
    launch.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return pytest.fixture(name=cls.__name__)(launch)


def get_test_path(filename: str) -> str:
    """Return the path of `filename` inside tests/unit."""
    return str(Path(__file__).parent / filename)


def preferred_dtype() -> torch.dtype:
    """Return bf16 when the accelerator supports it, else fp16 when supported, else fp32."""
    if get_accelerator().is_bf16_supported():
        return torch.bfloat16
    if get_accelerator().is_fp16_supported():
        return torch.float16
    return torch.float32


def is_rocm_pytorch() -> bool:
    """Return True on ROCm builds of torch."""
    return getattr(torch.version, "hip", None) is not None


class EnableDeterminism:
    """Context manager: seed every RNG with seed + LOCAL_RANK and force deterministic kernels, then restore."""

    def __init__(self, seed: int) -> None:
        """Remember the seed, offset by this rank's LOCAL_RANK so ranks draw different numbers."""
        self.seed = seed + int(os.environ.get("LOCAL_RANK", "0"))
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> Self:
        accelerator = get_accelerator()
        self._saved = {
            "random": random.getstate(),
            "torch": torch.get_rng_state(),
            "accelerator": accelerator.get_rng_state() if accelerator.is_available() else None,
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "env": {k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG", "CUDA_LAUNCH_BLOCKING")},
        }
        random.seed(self.seed)
        torch.manual_seed(self.seed)
        accelerator.manual_seed_all(self.seed)
        os.environ["CUDA_LAUNCH_BLOCKING"] = "1"
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"  # required by deterministic cuBLAS
        torch.use_deterministic_algorithms(True)
        return self

    def __exit__(self, *exc_info: object) -> None:
        random.setstate(self._saved["random"])
        torch.set_rng_state(self._saved["torch"])
        if self._saved["accelerator"] is not None:
            get_accelerator().set_rng_state(self._saved["accelerator"])
        torch.use_deterministic_algorithms(self._saved["deterministic"])
        for key, value in self._saved["env"].items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def enable_determinism(seed: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a test so it runs inside EnableDeterminism(seed)."""

    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with EnableDeterminism(seed):
                return func(*args, **kwargs)

        return wrapper

    return decorator


def reduce_boolean_flags(flag: bool, op: Callable[[list[bool]], bool] = all, group: Any = None) -> bool:
    """Return `op` (all / any) over every rank's `flag`."""
    device = get_accelerator().current_device_name()
    local = torch.tensor([int(bool(flag))], dtype=torch.int32, device=device)
    gathered = torch.empty(dist.get_world_size(group), dtype=torch.int32, device=device)
    dist.all_gather_into_tensor(gathered, local, group=group)
    return op(bool(v) for v in gathered.tolist())


def allclose_on_all_ranks(
    actual: torch.Tensor, expected: torch.Tensor, assert_message: str | None = None, **kwargs: Any
) -> None:
    """Assert that torch.allclose(actual, expected, **kwargs) holds on every rank.

    Raises:
        AssertionError: on every rank, when any rank's tensors differ.
    """
    if not reduce_boolean_flags(torch.allclose(actual, expected, **kwargs), all):
        raise AssertionError(
            assert_message or f"Tensors are not close on every rank: {actual=}, {expected=}, {kwargs=}"
        )
