"""unit/python_process.py runs a script as `python SCRIPT ARGS` would: its argv, environment, working directory,
script directory on sys.path, `__main__`, output streams and exit status, in a process of its own."""

import os
import sys

from unit.python_process import run_python

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
