"""MuonWithAuxAdam on a group laid out as one run (ZeRO's masters): the whole-group fold gives the same bits as the
per-shape folds, and it is the one taken.

Under ZeRO a rank's Muon masters are slices of one flat fp32 partition in the group's order (largest first), their
fp32 gradients are slices of one buffer in the same order, and the optimizer packs the momenta the same way; the
step then folds and reads all momenta as one tensor: one call of the fold for the group.
"""

import pytest
import torch

from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
from deepspeed.runtime.zero.muon.original_muon import count_newton_schulz_calls, flat_view

# Already in the optimizer's order (largest first, stable), as ZeRO lays them out.
SHAPES = [(24, 16)] * 2 + [(16, 24)] * 3 + [(8, 8)]


def flat_params(generator):
    """Params and a gradient buffer as slices of two flat tensors, like ZeRO's masters and fp32 gradients."""
    numels = [torch.Size(shape).numel() for shape in SHAPES]
    master = torch.randn(sum(numels), generator=generator)
    params = [torch.nn.Parameter(piece.view(shape)) for piece, shape in zip(master.split(numels), SHAPES)]
    return params, numels


def counting_folds(optimizer, calls):
    """Count the executor's calls of the fold kernel (one per group laid out as one run, else one per shape)."""
    kernels = optimizer._executor.kernels

    class Counting:
        apply_update = staticmethod(kernels.apply_update)

        @staticmethod
        def fold_and_direction(*args, **kwargs):
            calls.append(args[0].shape)
            return kernels.fold_and_direction(*args, **kwargs)

    optimizer._executor.kernels = Counting


def optimizer_for(params, nesterov, ns_method):
    return MuonWithAuxAdam([{"params": params, "use_muon": True, "lr": 0.05, "momentum": 0.9,
                             "nesterov": nesterov, "weight_decay": 0.1, "ns_method": ns_method}])


@pytest.mark.parametrize("ns_method", ["gram", "standard", "gram_sym"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_whole_group_path_matches_per_shape_path_bit_for_bit(nesterov, ns_method):
    flat, numels = flat_params(torch.Generator().manual_seed(0))
    # The same values in separate allocations: nothing is one run, so the per-shape path runs.
    separate = [torch.nn.Parameter(p.detach().clone()) for p in flat]
    flat_opt, separate_opt = optimizer_for(flat, nesterov, ns_method), optimizer_for(separate, nesterov, ns_method)
    flat_folds, separate_folds = [], []
    counting_folds(flat_opt, flat_folds)
    counting_folds(separate_opt, separate_folds)
    for step in range(4):
        generator = torch.Generator().manual_seed(100 + step)
        grad_buffer = torch.randn(sum(numels), generator=generator)
        for p, q, grad in zip(flat, separate, grad_buffer.split(numels)):
            p.grad = grad.view(p.shape)
            q.grad = grad.view(p.shape).clone()
        flat_folds.clear()
        separate_folds.clear()
        for optimizer in (flat_opt, separate_opt):
            with count_newton_schulz_calls() as calls:
                optimizer.step()
            assert sum(calls.values()) == 1
        # The first step too: the step packs the momenta it creates before folding.
        assert flat_folds == [torch.Size([sum(numels)])]
        assert len(separate_folds) == len(set(SHAPES))
        for p, q in zip(flat, separate):
            assert torch.equal(p, q)
            assert torch.equal(flat_opt.state[p]["momentum_buffer"], separate_opt.state[q]["momentum_buffer"])
    assert flat_view([flat_opt.state[p]["momentum_buffer"] for p in flat]) is not None


def test_gradients_out_of_order_take_the_per_shape_path():
    flat, numels = flat_params(torch.Generator().manual_seed(1))
    optimizer = optimizer_for(flat, True, "gram")
    folds = []
    counting_folds(optimizer, folds)
    grad_buffer = torch.randn(sum(numels))
    grads = list(grad_buffer.split(numels))
    # Swap the gradients of two same-shape params: each still lies in one buffer, but not in the params' order.
    grads[2], grads[3] = grads[3], grads[2]
    for _ in range(2):
        for p, grad in zip(flat, grads):
            p.grad = grad.view(p.shape)
        folds.clear()
        optimizer.step()
        assert len(folds) == len(set(SHAPES))


def test_flat_view_refuses_what_is_not_one_run_in_order():
    buffer = torch.arange(20.0)
    a, b, c = buffer[0:6].view(2, 3), buffer[6:10], buffer[10:20].view(5, 2)
    view = flat_view([a, b, c])
    assert view is not None and view.data_ptr() == buffer.data_ptr() and view.numel() == 20
    view[7] = -1
    assert b[1] == -1  # the view is the tensors' memory, not a copy
    assert flat_view([b, a]) is None                      # out of order
    assert flat_view([a, c]) is None                      # a gap
    assert flat_view([a, b.double()]) is None             # another dtype
    assert flat_view([buffer[0:6].view(3, 2).t(), b]) is None  # not contiguous
    assert flat_view([a, torch.zeros(4)]) is None         # another allocation
