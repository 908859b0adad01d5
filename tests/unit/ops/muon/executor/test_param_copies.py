"""``MuonWithAuxAdam.step(fp16_param_groups=...)`` where the params are, with the copies in the lent workspace, as
ZeRO passes its lp weights: each copy is ``param.to(copy.dtype)`` after every step, and the params and state are
those of a step without copies or workspace, bit for bit. The copies' memory is also where Newton-Schulz runs, so a
copy written too early would show as a wrong param or a wrong copy."""

import pytest
import torch

from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.muon.math.update import flat_view
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

# Two Muon groups (the first one's copies can only be written after the second one's Newton-Schulz), then Adam.
# Wide, tall and square matrices: in "gram_sym" the wide and tall results are fp16 in the direction's memory (the
# copies themselves, for the last group), the squares' in memory of their own.
GROUPS = [[(64, 96), (64, 96)], [(64, 192), (64, 192), (192, 64), (192, 64), (64, 64), (64, 64)]]
BIASES = [(64, ), (96, )]


def device():
    name = get_accelerator().device_name()
    return torch.device("cpu" if name == "cpu" else f"{name}:{get_accelerator().current_device()}")


def views(buffer, shapes):
    out, start = [], 0
    for shape in shapes:
        numel = torch.Size(shape).numel()
        out.append(buffer[start:start + numel].view(shape))
        start += numel
    return out


def masters_of():
    """Per group, fp32 masters as views of one buffer (as ZeRO's)."""
    generator = torch.Generator().manual_seed(0)
    masters = []
    for shapes in GROUPS + [BIASES]:
        numel = sum(torch.Size(shape).numel() for shape in shapes)
        masters.append(views(torch.randn(numel, generator=generator).to(device()), shapes))
    return masters


def copies_of(optimizer, dtype, aligned):
    """Per param group, in the optimizer's order of its params, copies as views of one buffer in ``dtype``, 256-byte
    aligned (as ZeRO's lp weights: the last group's direction is carved at its copies) or one element past that
    (the directions go elsewhere and the copies' memory holds other results)."""
    copies = []
    for group in optimizer.param_groups:
        numel = sum(p.numel() for p in group["params"])
        # 256-byte aligned, as the caching allocator aligns ZeRO's buffers: the workspace then carves from its start.
        padded = torch.full((numel + 128, ), float("nan"), dtype=dtype, device=device())
        start = (-padded.data_ptr() % 256) // padded.element_size() + (0 if aligned else 1)
        copies.append(views(padded[start:start + numel], [(p.numel(), ) for p in group["params"]]))
    return copies


def set_grads(masters, step):
    generator = torch.Generator().manual_seed(100 + step)
    for group in masters:
        for p in group:
            p.grad = torch.randn(p.shape, generator=generator).to(device())


def make(masters):
    groups = [{"params": group, "use_muon": True, "lr": 0.02, "weight_decay": 0.01, "ns_method": "gram_sym",
               "ns_dtype": torch.bfloat16} for group in masters[:-1]]
    groups.append({"params": masters[-1], "use_muon": False, "lr": 1e-2, "weight_decay": 0.01})
    return MuonWithAuxAdam(groups)


@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_copies_in_the_workspace_are_the_params_cast(dtype, aligned):
    runs = []
    for with_copies in (False, True):
        masters = masters_of()
        optimizer = make(masters)
        copies = copies_of(optimizer, dtype, aligned)
        if with_copies:
            # The copies' buffers, as ZeRO lends its lp weights: Newton-Schulz runs in them.
            optimizer.lend_step_workspace([flat_view(group) for group in copies])
        for step in range(3):
            set_grads(masters, step)
            optimizer.step(fp16_param_groups=copies if with_copies else None)
            if with_copies:
                for group, group_copies in zip(optimizer.param_groups, copies):
                    for p, c in zip(group["params"], group_copies):
                        assert torch.equal(c.view(torch.int16), p.reshape(-1).to(dtype).view(torch.int16)), \
                            f"step {step}, shape {tuple(p.shape)}"
        runs.append((masters, optimizer))
    (plain, plain_opt), (written, written_opt) = runs
    for plain_group, written_group in zip(plain, written):
        for a, b in zip(written_group, plain_group):
            assert torch.equal(a, b)
            for key, value in written_opt.state[a].items():
                assert torch.equal(value, plain_opt.state[b][key])


def test_other_copies_at_a_later_step_are_the_ones_written():
    """The copies are looked up again when other tensors come (a new list, or one entry replaced in the same list):
    each step writes exactly the copies it was given."""
    masters = masters_of()
    optimizer = make(masters)
    first = copies_of(optimizer, torch.bfloat16, aligned=False)
    second = copies_of(optimizer, torch.bfloat16, aligned=False)
    for step, copies in enumerate((first, first, second)):
        set_grads(masters, step)
        optimizer.step(fp16_param_groups=copies)
    replaced = second[1][0]
    second[1][0] = torch.full_like(replaced, float("nan"))
    set_grads(masters, 3)
    optimizer.step(fp16_param_groups=second)
    for group, first_copies, second_copies in zip(optimizer.param_groups, first, second):
        for p, old, new in zip(group["params"], first_copies, second_copies):
            cast = p.reshape(-1).to(torch.bfloat16).view(torch.int16)
            assert torch.equal(new.view(torch.int16), cast), f"shape {tuple(p.shape)}"
            assert not torch.equal(old.view(torch.int16), cast), f"shape {tuple(p.shape)}: an old copy was written"
    assert not torch.equal(replaced.view(torch.int16), optimizer.param_groups[1]["params"][0].reshape(-1).to(
        torch.bfloat16).view(torch.int16)), "the replaced copy was written"


def test_the_same_copies_grouped_otherwise_are_refused():
    """A list that holds the tensors of an accepted step, one moved into the next group, is checked again: the
    mapping kept from that step is not handed back for it."""
    masters = masters_of()
    optimizer = make(masters)
    copies = copies_of(optimizer, torch.bfloat16, aligned=True)
    set_grads(masters, 0)
    optimizer.step(fp16_param_groups=copies)
    regrouped = [list(group_copies) for group_copies in copies]
    regrouped[1].insert(0, regrouped[0].pop())
    set_grads(masters, 1)
    with pytest.raises(ValueError, match=r"fp16_param_groups\[0\] must be a list of one tensor per param"):
        optimizer.step(fp16_param_groups=regrouped)
