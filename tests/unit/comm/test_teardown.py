"""`destroy_process_group` frees the world group after a training run, in fresh interpreters (two gloo ranks, as
torchrun starts them): the engine built a torch optimizer, which imports torch.distributed.nn.functional, whose
collectives bind the world group as a default argument when imported after the group exists. A group that outlives
`destroy_process_group` keeps gloo's worker threads running into the interpreter's exit, where one that drops the
last reference to a finished collective aborts the process (an intermittent "terminate called without an active
exception" at the end of a run that had succeeded)."""

import os
import subprocess
import sys
import textwrap

from unit.python_process import free_port

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SCRIPT = textwrap.dedent("""
    import gc
    import sys
    import weakref

    import torch

    import deepspeed
    import deepspeed.comm as dist
    from unit.simple_model import SimpleModel

    deepspeed.init_distributed()
    model = SimpleModel(hidden_dim=8)
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    y = torch.randint(0, 8, (2,))
    engine.backward(engine(x, y))
    engine.step()
    del engine, _, model
    world = weakref.ref(dist.get_world_group())
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()
    if world() is not None:
        print("the world group outlived destroy_process_group")
        sys.exit(3)
""")


def test_destroy_process_group_frees_the_world_group_after_training(tmp_path):
    script = tmp_path / "train_and_destroy.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, os.path.join(REPO_ROOT, "tests"),
                                                      env.get("PYTHONPATH")]))
    # Two fresh interpreters with the variables torchrun would give them (torchrun's own interpreter, which imports
    # torch only to watch them, is left out: 1.5 s of CPU).
    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, str(script)], env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank),
                                                                       WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                                                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    try:
        outputs = [rank.communicate(timeout=300) for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    for rank, (out, err) in zip(ranks, outputs):
        assert rank.returncode == 0, f"rank of {script} failed ({rank.returncode}):\n{out[-4000:]}\n{err[-4000:]}"
