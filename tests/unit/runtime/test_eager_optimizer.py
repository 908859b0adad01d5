"""This package's own optimizers (Muon, CPU Adam) train, checkpoint and resume without importing torch._dynamo,
which torch's wrapped Optimizer methods import on first call (runtime/eager_optimizer.py)."""

import subprocess
import sys
import textwrap

from unit.python_process import free_port, repo_env


def test_muon_and_cpu_adam_runs_never_import_torch_dynamo(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        import torch
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from unit.simple_model import SimpleModel

        model = SimpleModel(8)
        config = {{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {{"stage": 2}},
                   "bf16": {{"enabled": True}}, "optimizer": {{"type": "Muon", "params": {{"lr": 0.01}}}}}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        x, y = torch.randn(2, 8, dtype=torch.bfloat16), torch.randint(0, 8, (2,))
        engine.backward(engine(x, y))
        engine.step()
        engine.save_checkpoint({str(tmp_path)!r})
        engine.load_checkpoint({str(tmp_path)!r})
        engine.optimizer.zero_grad()

        param = torch.nn.Parameter(torch.ones(4))
        adam = DeepSpeedCPUAdam([param], lr=0.1)
        param.grad = torch.ones(4)
        adam.step()
        adam.load_state_dict(adam.state_dict())
        adam.zero_grad()
        print("torch._dynamo" in sys.modules, float(param[0]) < 1.0)
    """)
    env = repo_env(DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180,
                            check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.split()[-2:] == ["False", "True"], "torch._dynamo was imported (first value)"
