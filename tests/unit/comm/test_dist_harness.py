"""The DistributedTest harness itself: failures, skips, crashes and hangs are reported, never swallowed."""

import json
import os
import random
import time

import pytest
import torch
from unit import dist_launcher
from unit.common import (
    DistributedExec,
    DistributedFixture,
    DistributedTest,
    allclose_on_all_ranks,
    enable_determinism,
    get_master_port,
    reduce_boolean_flags,
)

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator


def _rank() -> int:
    return int(os.environ["RANK"])


class _Probe(DistributedExec):
    """Ranks run whichever behaviour a test names; results come back through files in `out_dir`.

    Most behaviours need no process group, so ranks start in milliseconds even where NCCL setup is slow.
    """

    world_size = 2
    init_distributed = False

    def raise_on_rank_one(self):
        if _rank() == 1:
            raise ValueError("rank one exploded")

    def skip_everywhere(self):
        pytest.skip("no widgets on this host")

    def exit_on_rank_one(self):
        if _rank() == 1:
            os._exit(7)

    def sleep_forever(self, out_dir):
        with open(os.path.join(out_dir, f"pid_{_rank()}"), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)

    def rank_zero_sleeps_rank_one_fails(self):
        if _rank() == 0:
            time.sleep(600)
        raise RuntimeError("rank one gave up")

    def change_process_state(self, out_dir):
        os.environ["DS_HARNESS_PROBE"] = "set by a test"
        os.environ.pop("RANK")
        torch.set_default_dtype(torch.float64)
        torch.set_grad_enabled(False)
        os.chdir(out_dir)

    def record_process_state(self, out_dir):
        state = (os.environ.get("DS_HARNESS_PROBE"), os.environ.get("RANK"), str(torch.get_default_dtype()),
                 torch.is_grad_enabled(), os.getcwd())
        with open(os.path.join(out_dir, f"state_{dist.get_rank()}"), "w") as f:
            json.dump(state, f)

    def record_pid(self, out_dir, tag):
        assert dist.is_initialized() and dist.get_world_size() == 2
        with open(os.path.join(out_dir, f"{tag}_{dist.get_rank()}"), "w") as f:
            f.write(str(os.getpid()))


def _read_pids(out_dir, prefix):
    return sorted(
        int(open(os.path.join(out_dir, name)).read()) for name in os.listdir(out_dir) if name.startswith(prefix)
    )


def _is_running(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_rank_error_fails_with_remote_traceback():
    with pytest.raises(pytest.fail.Exception) as info:
        _Probe()._launch_procs(2, "raise_on_rank_one")
    message = str(info.value)
    assert "Rank 1 failed" in message
    assert "ValueError: rank one exploded" in message
    assert "in raise_on_rank_one" in message  # the remote frame, not the launcher's


def test_skip_in_ranks_skips_the_test():
    reason = _Probe()._skip_reason(2)  # one GPU: the harness skips before the ranks start
    if reason is not None:
        pytest.skip(reason)
    with pytest.raises(pytest.skip.Exception, match="no widgets on this host"):
        _Probe()._launch_procs(2, "skip_everywhere")


def test_crashed_rank_is_reported():
    with pytest.raises(pytest.fail.Exception, match="Worker 1 exited with code 7"):
        _Probe()._launch_procs(2, "exit_on_rank_one")


def test_hang_fails_within_timeout_and_kills_ranks(tmp_path):
    probe = _Probe()
    probe.exec_timeout = 2
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as info:
        probe._launch_procs(2, "sleep_forever", {"out_dir": str(tmp_path)})
    elapsed = time.monotonic() - start
    assert "Test hung: rank(s) [0, 1]" in str(info.value) and "exec_timeout=2" in str(info.value)
    assert elapsed < 10, f"a 2 s timeout took {elapsed:.1f} s to report"
    pids = _read_pids(tmp_path, "pid_")
    assert len(pids) == 2 and not any(_is_running(pid) for pid in pids)


def test_straggler_after_failure_is_terminated(monkeypatch):
    monkeypatch.setattr(dist_launcher, "STRAGGLER_GRACE_S", 0.5)
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as info:
        _Probe()._launch_procs(2, "rank_zero_sleeps_rank_one_fails")
    assert "RuntimeError: rank one gave up" in str(info.value)
    assert "Rank(s) [0] were terminated" in str(info.value)
    assert time.monotonic() - start < 10


def test_reused_ranks_survive_between_tests(tmp_path):
    probe = _Probe()
    probe.init_distributed = probe.reuse_dist_env = True
    try:
        probe._launch_procs(2, "record_pid", {"out_dir": str(tmp_path), "tag": "first"})
        probe._launch_procs(2, "record_pid", {"out_dir": str(tmp_path), "tag": "second"})
        first = _read_pids(tmp_path, "first_")
        assert len(first) == 2 and first == _read_pids(tmp_path, "second_")
        assert os.getpid() not in first

        # A failure may leave ranks stuck in a collective, so the pool is replaced.
        with pytest.raises(pytest.fail.Exception, match="rank one exploded"):
            probe._launch_procs(2, "raise_on_rank_one")
        probe._launch_procs(2, "record_pid", {"out_dir": str(tmp_path), "tag": "third"})
        third = _read_pids(tmp_path, "third_")
        assert len(third) == 2 and not set(third) & set(first)
    finally:
        DistributedExec.close_pools()
    assert not any(_is_running(pid) for pid in third)


def test_reused_ranks_start_each_test_from_the_state_they_were_set_up_with(tmp_path):
    """What a test changes in its ranks' processes (environment, default dtype, grad mode, working directory) is
    gone when the next test runs on the same pooled ranks."""
    probe = _Probe()
    probe.init_distributed = probe.reuse_dist_env = True
    try:
        probe._launch_procs(2, "change_process_state", {"out_dir": str(tmp_path)})
        probe._launch_procs(2, "record_process_state", {"out_dir": str(tmp_path)})
    finally:
        DistributedExec.close_pools()
    for rank in range(2):
        state = json.loads((tmp_path / f"state_{rank}").read_text())
        assert state == [None, str(rank), "torch.float32", True, os.getcwd()], state


def test_cpu_ranks_are_pooled_unless_a_class_says_otherwise():
    assert DistributedTest.reuse_dist_env is None
    default, fresh = _Probe(), _Probe()
    default.init_distributed = fresh.init_distributed = True
    fresh.reuse_dist_env = False
    assert default._uses_pool() == (get_accelerator().device_name() == "cpu")
    assert not fresh._uses_pool()


def test_master_port_ranges_per_xdist_worker(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    assert 32500 <= get_master_port() < 33500
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert 29500 <= get_master_port() < 30500


def test_enable_determinism_repeats_and_restores():

    @enable_determinism(123)
    def draw():
        return random.random(), torch.rand(3)

    torch.manual_seed(5)
    after_seed = torch.get_rng_state()
    first, second = draw(), draw()
    assert first[0] == second[0] and torch.equal(first[1], second[1])
    assert torch.equal(torch.get_rng_state(), after_seed)
    assert not torch.are_deterministic_algorithms_enabled()


class write_rank_files(DistributedFixture):
    """Distributed fixture: three ranks each leave a file behind for the test that uses it."""

    world_size = 3

    def run(self, class_tmpdir):
        class_tmpdir.join(f"fixture_rank_{dist.get_rank()}").write(str(dist.get_world_size()))


class TestDistributedFixture(DistributedTest):
    world_size = 1

    def test_fixture_ran_on_its_own_world(self, write_rank_files, class_tmpdir):
        assert dist.get_world_size() == 1
        files = sorted(p.basename for p in class_tmpdir.listdir() if p.basename.startswith("fixture_rank_"))
        assert files == ["fixture_rank_0", "fixture_rank_1", "fixture_rank_2"]
        assert all(class_tmpdir.join(name).read() == "3" for name in files)


class TestRankAgreementHelpers(DistributedTest):
    world_size = 2

    def test_reduce_boolean_flags(self):
        rank = dist.get_rank()
        assert reduce_boolean_flags(rank == 0, any) is True
        assert reduce_boolean_flags(rank == 0, all) is False
        assert reduce_boolean_flags(True, all) is True

    def test_allclose_on_all_ranks(self):
        rank = dist.get_rank()
        allclose_on_all_ranks(torch.ones(2), torch.ones(2))
        # Only rank 1 differs, yet every rank must raise.
        with pytest.raises(AssertionError, match="differ on rank"):
            allclose_on_all_ranks(torch.ones(2) + rank, torch.ones(2), assert_message="differ on rank")


@pytest.mark.hang_check
class TestDeliberateHang(DistributedTest):
    """Excluded by default; `pytest -m hang_check` must report this as FAILED after about 20 s."""

    world_size = 2
    exec_timeout = 20

    def test_hangs_and_is_reported_as_failure(self):
        if dist.get_rank() == 0:
            time.sleep(3600)
        dist.barrier()
