"""`import deepspeed` and the launcher start without torch; the rest of the surface loads on first use, whichever
module a process imports first."""

import subprocess
import sys
import textwrap

from unit.python_process import repo_env


def run_fresh(code: str) -> str:
    """Run `code` in a new interpreter (not a preloaded one: what it has imported is the point) and return stdout."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=repo_env(DS_ACCELERATOR="cpu"),
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def test_the_version_and_the_launcher_do_not_import_torch_and_the_surface_loads_on_use():
    out = run_fresh("""
        import sys
        import deepspeed
        import deepspeed.launcher.runner
        from deepspeed.utils import logger, z3_leaf_module
        assert "torch" not in sys.modules, "import deepspeed or the launcher imported torch"
        print(deepspeed.__version__ == deepspeed.git_version_info.version)
        import torch
        print(callable(z3_leaf_module) and not z3_leaf_module(torch.nn.Linear(2, 2)))
        print(deepspeed.initialize.__name__, deepspeed.zero.Init.__name__, deepspeed.comm.get_rank.__name__)
        from deepspeed import DeepSpeedConfigError
        from deepspeed.utils import safe_get_full_grad
        print(DeepSpeedConfigError.__name__, safe_get_full_grad.__name__)
        print(sorted(deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES)[0])
    """)
    assert out.split() == ["True", "True", "initialize", "Init", "get_rank", "DeepSpeedConfigError",
                           "safe_get_full_grad", "LRRangeTest"]


def test_a_process_that_imports_the_engine_first_still_sees_every_name():
    out = run_fresh("""
        import deepspeed.runtime.engine
        import deepspeed.public_api
        import deepspeed
        print(deepspeed.initialize.__name__, deepspeed.DeepSpeedEngine.__name__, deepspeed.HAS_TRITON)
    """)
    assert out.split() == ["initialize", "DeepSpeedEngine", "False"]
