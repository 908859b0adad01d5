"""Newton-Schulz in lent memory: the workspace carves deterministically and never hands out one byte twice, Newton-
Schulz run in it gives the bits of the allocating run, and MuonWithAuxAdam stepping in a lent workspace (what ZeRO
does) gives the bits of the optimizer that was lent nothing.
"""

import weakref

import pytest
import torch

from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam, muon_param_groups
from deepspeed.runtime.zero.muon.executor.ns_workspace import ALIGNMENT, NSWorkspace
from deepspeed.runtime.zero.muon.original_muon import (count_newton_schulz_calls, zeropower_via_gram_newtonschulz,
                                                       zeropower_via_newtonschulz5)
from deepspeed.runtime.zero.muon.math.symmetric_gram import zeropower_via_symmetric_gram

# Tall, wide and square batches, two sharing the small side (the joint Gram batch); the last two share a small side
# of 64, the symmetric Gram iteration's joint batch (smaller sides take its standard path).
BATCH_SHAPES = [(3, 48, 16), (2, 16, 40), (2, 16, 16), (1, 24, 24), (2, 64, 96), (1, 160, 64)]
NS = {"gram": zeropower_via_gram_newtonschulz, "standard": zeropower_via_newtonschulz5,
      "gram_sym": zeropower_via_symmetric_gram}


def byte_ranges(tensors):
    return sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)


def test_carving_is_deterministic_aligned_disjoint_and_inside_the_lent_buffers():
    lent = [torch.zeros(1000, dtype=torch.bfloat16), torch.zeros(3000, dtype=torch.float16)]
    workspace = NSWorkspace(lent)
    requests = [((10, 7), torch.float32), ((33,), torch.bfloat16), ((600,), torch.float32), ((5, 5), torch.float16)]
    first = [workspace.empty(shape, dtype) for shape, dtype in requests]
    for tensor, (shape, dtype) in zip(first, requests):
        assert tensor.shape == shape and tensor.dtype == dtype and tensor.is_contiguous()
        assert workspace.contains(tensor)
        assert tensor.data_ptr() % ALIGNMENT == 0
    ranges = byte_ranges(first)
    assert all(end <= start for (_, end), (start, _) in zip(ranges, ranges[1:])), "two carvings overlap"
    assert workspace.fallback_bytes == 0
    workspace.reset()
    again = [workspace.empty(shape, dtype) for shape, dtype in requests]
    assert [t.data_ptr() for t in again] == [t.data_ptr() for t in first]


def test_what_does_not_fit_is_allocated_once_and_reused_after_reset():
    workspace = NSWorkspace([torch.zeros(128)])  # 512 bytes: room for 8 floats wherever the buffer starts
    inside = workspace.empty((8,), torch.float32)
    outside = workspace.empty((1000,), torch.float32)
    assert workspace.contains(inside) and not workspace.contains(outside)
    assert workspace.fallback_bytes == 4000
    workspace.reset()
    workspace.empty((8,), torch.float32)
    assert workspace.empty((1000,), torch.float32).data_ptr() == outside.data_ptr()
    assert workspace.fallback_bytes == 4000


def test_what_does_not_fit_is_step_memory_and_can_be_reserved_again():
    """Released at the end of a step (memory held between steps would be held while the forward builds its
    activations); reserved again in the same sizes, the same requests carve the reserved memory, which is what a
    graph replay looks up by address."""
    workspace = NSWorkspace([torch.zeros(128)])
    requests = [((8,), torch.float32), ((1000,), torch.float32), ((300,), torch.bfloat16)]
    first = [workspace.empty(shape, dtype) for shape, dtype in requests]
    sizes = workspace.fallback_sizes
    assert sizes == (4000, 600) and workspace.fallback_bytes == 4600
    alive = weakref.ref(first[1].untyped_storage())
    del first
    workspace.release()
    assert workspace.fallback_bytes == 0 and workspace.fallback_sizes == ()
    assert alive() is None, "the released memory is still held"
    [workspace.empty(shape, dtype) for shape, dtype in requests]
    assert workspace.fallback_sizes == sizes


def test_workspace_refuses_buffers_it_cannot_carve():
    with pytest.raises(ValueError, match="1-D contiguous"):
        NSWorkspace([torch.zeros(4, 4)])
    with pytest.raises(ValueError, match="1-D contiguous"):
        NSWorkspace([torch.zeros(8)[::2]])


@pytest.mark.parametrize("coefficients", ["jordan", "polar_express"])
@pytest.mark.parametrize("steps", [0, 1, 2, 3, 5, 6])
@pytest.mark.parametrize("method, dtype", [("gram", torch.float32), ("standard", torch.float32),
                                           ("gram_sym", torch.float32), ("gram_sym", torch.bfloat16)])
def test_newton_schulz_in_a_workspace_gives_the_same_bits(method, dtype, steps, coefficients):
    """In bf16 the symmetric Gram iteration writes its fp16 input over the bf16 one, and its fp16 result in the same
    workspace."""
    generator = torch.Generator().manual_seed(steps)
    inputs = [torch.randn(shape, generator=generator).to(dtype) for shape in BATCH_SHAPES]
    expected = NS[method]([x.clone() for x in inputs], steps=steps, dtype=dtype, coefficients=coefficients)
    # Room for everything: the input region first, as the optimizer carves it, then Newton-Schulz's tensors.
    workspace = NSWorkspace([torch.full((400_000,), float("nan"))])
    flat = workspace.empty((sum(x.numel() for x in inputs),), dtype)
    views, start = [], 0
    for x in inputs:
        views.append(flat[start:start + x.numel()].view(x.shape))
        views[-1].copy_(x)
        start += x.numel()
    results = NS[method](views, steps=steps, dtype=dtype, workspace=workspace, coefficients=coefficients)
    for shape, result, reference in zip(BATCH_SHAPES, results, expected):
        # "gram_sym" returns its Gram iteration's results in fp16, the dtype they were iterated in.
        gram_path = method == "gram_sym" and min(shape[-2:]) >= 64 and shape[-1] != shape[-2]
        assert result.dtype == (torch.float16 if gram_path and dtype == torch.bfloat16 else dtype)
        assert torch.equal(result, reference)
        assert workspace.contains(result)  # nothing was allocated for the results
    assert workspace.fallback_bytes == 0


def test_newton_schulz_in_a_workspace_needs_the_compute_dtype():
    with pytest.raises(ValueError, match="compute dtype"):
        zeropower_via_gram_newtonschulz([torch.randn(4, 8, dtype=torch.float64)], dtype=torch.float32,
                                        workspace=NSWorkspace([]))


def optimizer_and_params(generator, shapes, nesterov, ns_method="gram", coefficients="jordan"):
    numels = [torch.Size(shape).numel() for shape in shapes]
    master = torch.randn(sum(numels), generator=generator)
    params = [torch.nn.Parameter(piece.view(shape)) for piece, shape in zip(master.split(numels), shapes)]
    optimizer = MuonWithAuxAdam([{"params": params, "use_muon": True, "lr": 0.05, "momentum": 0.9,
                                  "nesterov": nesterov, "weight_decay": 0.1, "ns_method": ns_method,
                                  "ns_coefficients": coefficients}])
    return optimizer, params, numels


# The optimizer's order (by size(), largest first). The symmetric Gram iteration takes its Gram path from a small
# side of 64.
OPTIMIZER_SHAPES = {"gram": [(48, 16)] * 2 + [(24, 24)] + [(16, 40)] * 3,
                    "gram_sym": [(160, 64)] * 2 + [(64, 96)] + [(64, 64)] + [(16, 40)] * 2}


@pytest.mark.parametrize("coefficients", ["jordan", "polar_express"])
@pytest.mark.parametrize("ns_method", ["gram", "gram_sym"])
@pytest.mark.parametrize("room", ["all", "some"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_optimizer_in_a_lent_workspace_gives_the_same_bits(nesterov, room, ns_method, coefficients):
    shapes = OPTIMIZER_SHAPES[ns_method]
    lent_opt, lent_params, numels = optimizer_and_params(torch.Generator().manual_seed(0), shapes, nesterov,
                                                         ns_method, coefficients)
    plain_opt, plain_params, _ = optimizer_and_params(torch.Generator().manual_seed(0), shapes, nesterov, ns_method,
                                                      coefficients)
    lent = torch.zeros(600_000 if room == "all" else 3_000, dtype=torch.bfloat16)
    lent_opt.lend_step_workspace([lent])
    for step in range(4):
        grads = torch.randn(sum(numels), generator=torch.Generator().manual_seed(100 + step))
        for p, q, grad in zip(lent_params, plain_params, grads.split(numels)):
            p.grad, q.grad = grad.view(p.shape), grad.view(p.shape).clone()
        lent.fill_(float("nan"))  # the lender's contents are dead: nothing may read them
        computed_in_step = []
        fold = lent_opt._executor.fold
        lent_opt._executor.fold = _recording(fold, computed_in_step)
        for optimizer in (lent_opt, plain_opt):
            with count_newton_schulz_calls() as calls:
                optimizer.step()
            # One Newton-Schulz call for the group; lent a workspace, every step (the first too: it packs the
            # momenta) runs it there.
            assert sum(calls.values()) == 1
        del lent_opt._executor.fold
        assert computed_in_step == [True]
        for p, q in zip(lent_params, plain_params):
            assert torch.equal(p, q)
            assert torch.equal(lent_opt.state[p]["momentum_buffer"], plain_opt.state[q]["momentum_buffer"])
        assert not torch.isnan(lent).all(), "the lent buffer was not used"
        assert lent_opt._executor.workspace.fallback_bytes == 0, "step memory outlived the step"


def _recording(fold, record):
    """``fold`` recording whether the group's directions were carved from the lent workspace."""
    def recorded(group, *args):
        folded = fold(group, *args)
        record.append(folded is not None and folded.in_workspace is not None)
        return folded
    return recorded


def test_cuda_graph_flag_must_be_a_bool():
    with pytest.raises(ValueError, match="ns_cuda_graph must be true or false"):
        MuonWithAuxAdam([{"params": [torch.nn.Parameter(torch.zeros(4, 4))], "use_muon": True,
                          "ns_cuda_graph": "yes"}])


def test_no_gradient_outlives_the_step():
    """Nothing the executor keeps between steps may hold the gradients alive into the next forward and backward:
    under ZeRO they can be a full fp32 copy of the rank's gradients."""
    optimizer, params, numels = optimizer_and_params(torch.Generator().manual_seed(4), [(16, 8)] * 3, True)
    optimizer.lend_step_workspace([torch.zeros(10_000)])
    for step in range(3):
        grads = torch.randn(sum(numels))
        for p, grad in zip(params, grads.split(numels)):
            p.grad = grad.view(p.shape)
        alive = weakref.ref(grads)
        optimizer.step()
        for p in params:
            p.grad = None
        del grads, grad
        assert alive() is None, f"step {step}: the optimizer still holds the gradients"


def test_the_config_key_reaches_the_muon_group():
    model = torch.nn.Linear(8, 8)
    model.weight.use_muon, model.bias.use_muon = True, False
    groups = muon_param_groups(model.named_parameters(), {"ns_cuda_graph": True})
    assert [group.get("ns_cuda_graph") for group in groups] == [True, None]
    assert MuonWithAuxAdam(groups).param_groups[0]["ns_cuda_graph"] is True
    # Off unless asked for: the graph's own stream costs a cuBLAS workspace (docs/muon.md).
    assert MuonWithAuxAdam(muon_param_groups(model.named_parameters(), {})).param_groups[0]["ns_cuda_graph"] is False
    with pytest.raises(ValueError, match="optimizer.params.ns_cuda_graph must be true or false, got 'yes'"):
        muon_param_groups(model.named_parameters(), {"ns_cuda_graph": "yes"})


def test_a_lent_buffer_that_is_itself_a_view_works():
    """The input is carved at a non-zero offset of its storage when the lent buffer is a slice of a larger one."""
    shapes = [(32, 16)] * 2 + [(16, 24)]
    lent_opt, lent_params, numels = optimizer_and_params(torch.Generator().manual_seed(5), shapes, True)
    plain_opt, plain_params, _ = optimizer_and_params(torch.Generator().manual_seed(5), shapes, True)
    storage = torch.zeros(100_000)
    lent_opt.lend_step_workspace([storage[999:]])  # not aligned either: carvings align their addresses
    for step in range(3):
        grads = torch.randn(sum(numels), generator=torch.Generator().manual_seed(200 + step))
        for p, q, grad in zip(lent_params, plain_params, grads.split(numels)):
            p.grad, q.grad = grad.view(p.shape), grad.view(p.shape).clone()
        for optimizer in (lent_opt, plain_opt):
            optimizer.step()
        for p, q in zip(lent_params, plain_params):
            assert torch.equal(p, q)


def test_what_did_not_fit_is_freed_after_each_step():
    """What did not fit in the lent buffers is one step's scratch. Kept, it cost about 8 bytes per owned Muon element
    under ZeRO-3, whose lent buffers are 1/N of the model, held while the forward builds activations."""
    optimizer, params, numels = optimizer_and_params(torch.Generator().manual_seed(5), [(48, 16)] * 2, True)
    optimizer.lend_step_workspace([torch.zeros(64)])  # room for almost nothing
    workspace = optimizer._executor.workspace
    held_at_release = []
    release = workspace.release

    def recording_release():
        held_at_release.append(workspace.fallback_bytes)
        release()

    workspace.release = recording_release
    for _ in range(3):
        for p, grad in zip(params, torch.randn(sum(numels)).split(numels)):
            p.grad = grad.view(p.shape)
        optimizer.step()
        assert workspace.fallback_bytes == 0
    # Newton-Schulz ran in the workspace and needed the fallback (it was there until the end of each step).
    assert all(held > 0 for held in held_at_release[1:]), held_at_release
