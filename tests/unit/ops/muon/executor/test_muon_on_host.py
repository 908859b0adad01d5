"""MuonWithAuxAdam stepping on the host (`run_on_host`, ZeRO-Offload's mode): the momentum fold and Nesterov direction
in the native op give torch's bits, so the Muon matrices follow the torch path exactly, laid out as ZeRO lays them
(one run) or not, before and after a checkpoint; the Adam half steps with the op within float rounding."""

import copy

import pytest
import torch

from deepspeed.ops.op_builder import CPUAdamBuilder
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

SHAPES = [(24, 16), (24, 16), (16, 8), (8, 3, 2, 2)]
BIASES = [(24, ), (8, )]


@pytest.fixture(scope="module", autouse=True)
def op():
    return CPUAdamBuilder().load()


def params_and_grads(flat: bool):
    """Matrices (and their gradients) as views of one buffer each, as ZeRO's masters are, or separate tensors."""
    generator = torch.Generator().manual_seed(0)
    numels = [torch.Size(shape).numel() for shape in SHAPES]
    values = torch.randn(sum(numels), generator=generator)
    if flat:
        matrices, start = [], 0
        for shape, numel in zip(SHAPES, numels):
            matrices.append(values[start:start + numel].view(shape))
            start += numel
    else:
        matrices = [torch.randn(shape, generator=generator) for shape in SHAPES]
    biases = [torch.randn(shape, generator=generator) for shape in BIASES]
    return matrices, biases


def set_grads(matrices, biases, step, flat):
    generator = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(m.shape, generator=generator) for m in matrices]
    if flat:
        buffer = torch.cat([g.reshape(-1) for g in grads])
        start = 0
        for m in matrices:
            m.grad = buffer[start:start + m.numel()].view(m.shape)
            start += m.numel()
    else:
        for m, g in zip(matrices, grads):
            m.grad = g
    for b in biases:
        b.grad = torch.randn(b.shape, generator=generator)


def make(matrices, biases, on_host):
    optimizer = MuonWithAuxAdam([{"params": matrices, "use_muon": True, "lr": 0.02, "weight_decay": 0.01},
                                 {"params": biases, "use_muon": False, "lr": 1e-2, "weight_decay": 0.01}])
    if on_host:
        optimizer.run_on_host("cpu")
    return optimizer


@pytest.mark.parametrize("flat", [True, False])
def test_host_steps_follow_the_torch_path(flat):
    runs = {}
    for on_host in (False, True):
        matrices, biases = params_and_grads(flat)
        optimizer = make(matrices, biases, on_host)
        for step in range(4):
            set_grads(matrices, biases, step, flat)
            optimizer.step()
            if step == 1:
                # A checkpoint round trip: the restored momenta are separate tensors (not one run) again.
                state = copy.deepcopy(optimizer.state_dict())
                optimizer = make(matrices, biases, on_host)
                optimizer.load_state_dict(state)
        runs[on_host] = (matrices, biases, optimizer)
    (torch_matrices, torch_biases, torch_opt), (host_matrices, host_biases, host_opt) = runs[False], runs[True]
    for a, b in zip(host_matrices, torch_matrices):
        assert torch.equal(a, b)
        assert torch.equal(host_opt.state[a]["momentum_buffer"], torch_opt.state[b]["momentum_buffer"])
    for a, b in zip(host_biases, torch_biases):
        assert ((a - b).norm() / b.norm()).item() < 1e-6
        for key in ("exp_avg", "exp_avg_sq"):
            assert ((host_opt.state[a][key] - torch_opt.state[b][key]).norm() / torch_opt.state[b][key].norm()) < 1e-6


@pytest.mark.parametrize("flat", [True, False])
def test_scaled_low_precision_gradients_give_the_unscaled_fp32_bits(flat):
    """ZeRO-Offload hands the host step the staged bf16 gradients and the unscale-and-clip factor: the op reads them
    as grad.float() * factor, so every tensor is bit for bit what unscaled fp32 gradients give (matrices against the
    torch path, the Adam half against the host path)."""
    factor = torch.tensor(0.37, dtype=torch.float32)
    runs = {}
    for mode in ("torch", "host", "host-scaled"):
        matrices, biases = params_and_grads(flat)
        optimizer = make(matrices, biases, on_host=mode != "torch")
        for step in range(3):
            set_grads(matrices, biases, step, flat)
            for p in matrices + biases:
                low = p.grad.to(torch.bfloat16)
                if mode == "host-scaled":
                    p.grad_dtype = None
                    p.grad = low
                else:
                    p.grad = low.float() * factor
            if mode == "host-scaled":
                optimizer.step(grad_factor=factor)
            else:
                optimizer.step()
        runs[mode] = (matrices, biases, optimizer)
    (torch_m, _, torch_opt), (host_m, host_b, host_opt), (scaled_m, scaled_b, scaled_opt) = (
        runs["torch"], runs["host"], runs["host-scaled"])
    for a, b, c in zip(scaled_m, host_m, torch_m):
        assert torch.equal(a, b) and torch.equal(a, c)
        assert torch.equal(scaled_opt.state[a]["momentum_buffer"], torch_opt.state[c]["momentum_buffer"])
    for a, b in zip(scaled_b, host_b):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(scaled_opt.state[a][key], host_opt.state[b][key])


def lp_copies(matrices, biases, dtype, contiguous):
    """One tensor per param for `step(fp16_param_groups=...)`: back to back in one buffer, as ZeRO-Offload's targets
    are, or not (every other slot of a buffer twice as long), NaN until written."""
    params = [matrices, biases]
    numel = sum(p.numel() for group in params for p in group)
    buffer = torch.full((numel * (1 if contiguous else 2), ), float("nan"), dtype=dtype)
    groups, start = [], 0
    for group in params:
        groups.append([])
        for p in group:
            groups[-1].append(buffer[start:start + p.numel()])
            start += p.numel() * (1 if contiguous else 2)
    return groups


@pytest.mark.parametrize("on_host", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("flat, contiguous", [(True, True), (True, False), (False, True)])
def test_the_step_writes_the_params_as_torch_casts_them(flat, contiguous, dtype, on_host):
    """With fp16_param_groups the step, on the host or where the params are, writes each updated param, Muon
    matrices and the Adam half, into its tensor: `param.to(dtype)` bit for bit after every step; the params and
    state are those of a step without copies."""
    factor = torch.tensor(0.37, dtype=torch.float32)
    runs = {}
    for with_copies in (False, True):
        matrices, biases = params_and_grads(flat)
        optimizer = make(matrices, biases, on_host=on_host)
        copies = lp_copies(matrices, biases, dtype, contiguous)
        for step in range(3):
            set_grads(matrices, biases, step, flat)
            optimizer.step(grad_factor=factor, fp16_param_groups=copies if with_copies else None)
            if with_copies:
                for p, c in zip(matrices + biases, copies[0] + copies[1]):
                    assert torch.equal(c.view(torch.int16), p.reshape(-1).to(dtype).view(torch.int16)), f"step {step}"
        runs[with_copies] = (matrices + biases, optimizer)
    (plain, plain_opt), (written, written_opt) = runs[False], runs[True]
    for a, b in zip(written, plain):
        assert torch.equal(a, b)
        for key, value in written_opt.state[a].items():
            assert torch.equal(value, plain_opt.state[b][key])


@pytest.mark.parametrize("param_dtype, copy_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.float16),
                                                     (torch.float16, torch.bfloat16)])
def test_16_bit_params_on_the_host_write_their_copies_as_torch_casts_them(param_dtype, copy_dtype):
    """Params kept in 16 bits on the host (no fp32 masters): the step still writes every updated param, Muon matrices
    and the Adam half, into its copy, `param.to(copy.dtype)` bit for bit after every step; the params are those of a
    step without copies."""
    runs = []
    for with_copies in (False, True):
        matrices, biases = params_and_grads(flat=False)
        matrices = [m.to(param_dtype) for m in matrices]
        biases = [b.to(param_dtype) for b in biases]
        optimizer = make(matrices, biases, on_host=True)
        copies = lp_copies(matrices, biases, copy_dtype, contiguous=True)
        for step in range(3):
            generator = torch.Generator().manual_seed(100 + step)
            for p in matrices + biases:
                p.grad = torch.randn(p.shape, generator=generator).to(param_dtype)
            optimizer.step(fp16_param_groups=copies if with_copies else None)
            if with_copies:
                for p, c in zip(matrices + biases, copies[0] + copies[1]):
                    assert torch.equal(c, p.reshape(-1).to(copy_dtype)), f"step {step}"
        runs.append(matrices + biases)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("on_host", [True, False])
def test_copies_need_one_tensor_per_param(on_host):
    matrices, biases = params_and_grads(flat=True)
    set_grads(matrices, biases, 0, flat=True)
    copies = lp_copies(matrices, biases, torch.bfloat16, contiguous=True)
    optimizer = make(matrices, biases, on_host=on_host)
    with pytest.raises(ValueError, match="fp16_param_groups has 1 entries, the optimizer 2 param groups"):
        optimizer.step(fp16_param_groups=copies[:1])
    with pytest.raises(ValueError, match=r"fp16_param_groups\[1\] must be a list of one tensor per param \(2\)"):
        optimizer.step(fp16_param_groups=[copies[0], copies[1][:1]])
    with pytest.raises(ValueError, match=r"fp16_param_groups\[0\] has a tensor of 3 elements for a param of 384"):
        optimizer.step(fp16_param_groups=[[torch.zeros(3)] + copies[0][1:], copies[1]])
