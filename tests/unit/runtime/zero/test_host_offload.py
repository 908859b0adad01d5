"""HostOffload's weights on their way back, with host memory on both ends (staged=True on the CPU): what the host step
wrote into the staging buffers reaches the partitions when published, and not before; weights the step did not write
are cast from the masters; without staging the step writes the partitions themselves and nothing is copied."""

import torch

from deepspeed.runtime.zero.offload import HostOffload

NUMELS = (37, 64)


def staged_offload(staged=True):
    offload = HostOffload(NUMELS, torch.float32, torch.bfloat16, torch.device("cpu"), pin_memory=True, staged=staged)
    lp = [torch.arange(n, dtype=torch.bfloat16) for n in NUMELS]
    masters = offload.host_masters(lp)
    return offload, lp, masters


def test_written_weights_reach_the_partitions_when_published():
    offload, lp, masters = staged_offload()
    before = [p.clone() for p in lp]
    targets = offload.lp_targets(lp)
    assert all(t.data_ptr() != p.data_ptr() for t, p in zip(targets, lp))
    for target in targets:
        target.copy_(-torch.arange(target.numel(), dtype=torch.bfloat16) - 1)
    assert all(torch.equal(p, b) for p, b in zip(lp, before))  # the step's writes stay on the host
    offload.send_weights(0, lp[0], masters[0], is_written=True)
    assert torch.equal(lp[0], targets[0]) and torch.equal(lp[1], before[1])
    offload.send_weights(1, lp[1], masters[1], is_written=True)
    assert all(torch.equal(p, t) for p, t in zip(lp, targets))


def test_unwritten_weights_are_cast_from_the_masters():
    offload, lp, masters = staged_offload()
    offload.lp_targets(lp)
    for group, master in enumerate(masters):
        master.copy_(torch.linspace(-3, 3, master.numel()))
        offload.send_weights(group, lp[group], master, is_written=False)
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(lp, masters))


def test_without_staging_the_step_writes_the_partitions_themselves():
    offload, lp, masters = staged_offload(staged=False)
    targets = offload.lp_targets(lp)
    assert [t.data_ptr() for t in targets] == [p.data_ptr() for p in lp]
    targets[0].fill_(7.0)
    offload.send_weights(0, lp[0], masters[0], is_written=True)  # nothing to copy
    assert torch.equal(lp[0], torch.full((37, ), 7.0, dtype=torch.bfloat16))
    masters[1].fill_(3.0)
    offload.send_weights(1, lp[1], masters[1], is_written=False)
    assert torch.equal(lp[1], torch.full((64, ), 3.0, dtype=torch.bfloat16))
