"""HostOffload's weights on their way back, with host memory on both ends (staged=True on the CPU): stretches sent
as the host step writes them plus what publishing sends cover each partition exactly; a tensor that is not a
stretch of the staging buffers is refused; without staging nothing is copied."""

import pytest
import torch

from deepspeed.runtime.zero.offload import HostOffload

NUMELS = (37, 64)


def staged_offload(staged=True):
    offload = HostOffload(NUMELS, torch.float32, torch.bfloat16, torch.device("cpu"), pin_memory=True, staged=staged)
    lp = [torch.arange(n, dtype=torch.bfloat16) for n in NUMELS]
    masters = offload.host_masters(lp)
    return offload, lp, masters


def test_written_stretches_and_the_rest_reach_the_partitions():
    offload, lp, masters = staged_offload()
    targets = offload.lp_targets(lp)
    assert all(t.data_ptr() != p.data_ptr() for t, p in zip(targets, lp))
    for target in targets:
        target.copy_(-torch.arange(target.numel(), dtype=torch.bfloat16) - 1)
    offload.send_written(targets[0][5:20])
    offload.send_written(targets[1][:64])
    assert torch.equal(lp[0][5:20], targets[0][5:20]) and torch.equal(lp[1], targets[1])
    assert torch.equal(lp[0][:5], torch.arange(5, dtype=torch.bfloat16))  # not sent yet
    for group, (partition, master) in enumerate(zip(lp, masters)):
        offload.send_weights(group, partition, master, is_written=True)
    assert all(torch.equal(p, t) for p, t in zip(lp, targets))


def test_a_tensor_outside_the_staging_buffers_is_refused():
    offload, lp, _ = staged_offload()
    offload.lp_targets(lp)
    with pytest.raises(ValueError, match="not a stretch of the weights' staging buffers"):
        offload.send_written(torch.zeros(3, dtype=torch.bfloat16))


def test_without_staging_the_step_writes_the_partitions_themselves():
    offload, lp, masters = staged_offload(staged=False)
    targets = offload.lp_targets(lp)
    assert [t.data_ptr() for t in targets] == [p.data_ptr() for p in lp]
    offload.send_written(targets[0][:4])  # nothing to copy
    masters[1].fill_(3.0)
    offload.send_weights(1, lp[1], masters[1], is_written=False)
    assert torch.equal(lp[1], torch.full((64, ), 3.0, dtype=torch.bfloat16))
