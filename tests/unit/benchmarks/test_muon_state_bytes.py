"""benchmarks/muon_state_bytes.py counts the state the real optimizer keeps: bf16 momenta take half the bytes of fp32
ones, NorMuon adds one fp32 value per row of every Muon matrix, and the Adam half does not change."""

import json
from pathlib import Path

from unit.python_process import repo_env, run_python

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_the_counted_bytes_follow_the_options(tmp_path):
    env = repo_env()
    result = run_python(str(REPO_ROOT / "benchmarks" / "muon_state_bytes.py"), ["--sizes", "gpt2-small", "--out",
                                                                                str(tmp_path)], env, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    counted = json.loads((tmp_path / "muon_state_bytes.json").read_text())["sizes"]["gpt2-small"]
    fp32, bf16 = counted["muon (fp32 momentum)"], counted["muon, momentum_dtype bf16"]
    normuon = counted["normuon"]
    muon_params = fp32["muon_params"]
    # GPT-2 small's hidden matrices: 12 blocks of 4 matrices of 768 x 768 * (3 + 1 + 4 + 4).
    assert muon_params == 12 * 12 * 768 * 768
    assert fp32["state"]["momentum_buffer float32"] == 4 * muon_params
    assert bf16["state"]["momentum_buffer bfloat16"] == 2 * muon_params
    rows = 12 * (3 * 768 + 768 + 4 * 768 + 768)  # qkv, out projection, MLP up, MLP down: their rows
    assert normuon["state"]["neuron_second_moment float32"] == 4 * rows
    for key in ("exp_avg float32", "exp_avg_sq float32"):
        assert fp32["state"][key] == bf16["state"][key] == normuon["state"][key]
