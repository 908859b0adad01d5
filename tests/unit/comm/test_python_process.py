"""unit/python_process.py runs a script as `python SCRIPT ARGS` would: its argv, environment, working directory,
script directory on sys.path, `__main__`, output streams and exit status, in a process of its own; and, as torchrun
would, on ranks of one process group."""

import os
import sys
import time

from unit.python_process import run_python, run_ranks

SCRIPT = '''
import os, sys
import helper_next_to_the_script
print("argv", sys.argv[1:], "name", __name__, "cwd", os.getcwd(), "probe", os.environ.get("PROBE"),
      "pid", os.getpid())
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
'''


def test_a_script_runs_as_the_interpreter_would_run_it(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    (tmp_path / "helper_next_to_the_script.py").write_text("")
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, PROBE="set for the child")
    for code in (0, 3):
        result = run_python(str(tmp_path / "script.py"), [str(code), "two words"], env, timeout=120, cwd=str(work))
        assert result.returncode == code, result.stderr
        assert f"argv ['{code}', 'two words'] name __main__ cwd {work} probe set for the child" in result.stdout
        assert f"pid {os.getpid()}" not in result.stdout
        assert result.stderr == "to stderr\n"
    assert "PROBE" not in os.environ or os.environ["PROBE"] != "set for the child"
    assert sys.argv[1:2] != ["3"]


def test_an_uncaught_exception_fails_with_its_traceback(tmp_path):
    (tmp_path / "boom.py").write_text("raise ValueError('no widgets')\n")
    result = run_python(str(tmp_path / "boom.py"), [], dict(os.environ), timeout=120)
    assert result.returncode == 1
    assert "ValueError: no widgets" in result.stderr and "Traceback" in result.stderr


RANKS_SCRIPT = '''
import os, sys
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
print("rank", os.environ["RANK"], "local", os.environ["LOCAL_RANK"], "of", os.environ["WORLD_SIZE"])
if dist.get_rank() == 1 and sys.argv[1] == "fail":
    sys.exit(3)
total = torch.ones(1)
dist.all_reduce(total)  # with "fail", rank 0 waits here for a rank that is gone
print("sum", int(total.item()))
dist.destroy_process_group()
'''


def test_ranks_form_one_group_and_a_failed_rank_ends_the_others(tmp_path):
    (tmp_path / "ranks.py").write_text(RANKS_SCRIPT)
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    ranks = run_ranks(str(tmp_path / "ranks.py"), ["pass"], env, world_size=2, timeout=120)
    for rank, result in enumerate(ranks):
        assert result.returncode == 0, result.stderr
        assert f"rank {rank} local {rank} of 2" in result.stdout and "sum 2" in result.stdout
    start = time.monotonic()
    ranks = run_ranks(str(tmp_path / "ranks.py"), ["fail"], env, world_size=2, timeout=120)
    assert ranks[1].returncode == 3 and ranks[0].returncode != 0
    assert time.monotonic() - start < 60, "the rank left waiting was not ended"
