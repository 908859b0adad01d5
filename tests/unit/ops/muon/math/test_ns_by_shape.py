"""ns_method "auto": each shape gets its method by a fixed rule of the shape, with that method's exact bits, in the
caller's order, in a workspace as without one."""

import pytest
import torch

from deepspeed.runtime.zero.muon.math import ns_by_shape
from deepspeed.runtime.zero.muon.math.ns_by_shape import SYMMETRIC_FROM_SIDE, method_for_shape
from deepspeed.runtime.zero.muon.executor.ns_workspace import NSWorkspace
from deepspeed.runtime.zero.muon.original_muon import NS_FUNCTIONS, zeropower_by_shape, zeropower_via_gram_newtonschulz
from deepspeed.runtime.zero.muon.math.symmetric_gram import zeropower_via_symmetric_gram


def test_the_rule_reads_the_smaller_side_only():
    side = SYMMETRIC_FROM_SIDE
    assert method_for_shape((side, 4 * side)) == method_for_shape((4 * side, side)) == "gram_sym"
    assert method_for_shape((side, side)) == method_for_shape((3, side, 2 * side)) == "gram_sym"
    assert method_for_shape((side - 1, 8 * side)) == method_for_shape((768, 3072)) == "gram"
    # The benchmark's models: GPT-2 small's matrices (m = 768) take gram, the 1.11B GPT's (m = 2048) gram_sym.
    assert method_for_shape((2048, 8192)) == "gram_sym" and method_for_shape((2304, 768)) == "gram"
    assert NS_FUNCTIONS["auto"] is zeropower_by_shape


# Small stand-ins for both sides of the rule: the threshold is lowered so that the split runs on CPU in a second.
SHAPES = [(2, 48, 96), (3, 128, 64), (2, 96, 96), (64, 256), (2, 40, 24)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lent", [False, True])
def test_each_shape_gets_its_methods_bits_in_order(monkeypatch, dtype, lent):
    monkeypatch.setattr(ns_by_shape, "SYMMETRIC_FROM_SIDE", 64)
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(shape, generator=generator).to(dtype) for shape in SHAPES]
    expected = []
    for one in inputs:
        function = zeropower_via_symmetric_gram if min(one.shape[-2:]) >= 64 else zeropower_via_gram_newtonschulz
        expected.append(function([one.clone()], 5, dtype)[0])
    assert [min(shape[-2:]) >= 64 for shape in SHAPES] == [False, True, True, True, False]
    if lent:
        workspace = NSWorkspace([torch.zeros(2_000_000, dtype=torch.uint8)])
        carved = [workspace.empty(one.shape, dtype) for one in inputs]
        for target, one in zip(carved, inputs):
            target.copy_(one)
        results = zeropower_by_shape(carved, 5, dtype, workspace)
    else:
        results = zeropower_by_shape(inputs, 5, dtype)
    for result, want, one in zip(results, expected, inputs):
        assert result.shape == one.shape and torch.equal(result, want)


def test_a_single_tensor_and_bad_input():
    X = torch.randn(32, 80, generator=torch.Generator().manual_seed(1))
    assert torch.equal(zeropower_by_shape(X), zeropower_via_gram_newtonschulz(X))
    with pytest.raises(ValueError, match="needs a matrix"):
        zeropower_by_shape([torch.randn(5)])
