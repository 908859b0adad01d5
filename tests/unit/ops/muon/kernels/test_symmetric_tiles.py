"""The triangular symmetric product: ``alpha A B^T + beta D + beta2 E + gamma I`` stored whole.

On a GPU with the kernel (Hopper on, Triton; m = 2048): as close to the fp32 product as cuBLAS's own product is,
every tile below the diagonal the transpose of the one above it, for X X^T with X's rows or columns contiguous and
for commuting symmetric factors with both addends and the diagonal; and the symmetric Newton-Schulz call with it
equals the call on cuBLAS's upper blocks to rounding. Everywhere (the CPU too): the fallbacks give the whole
product.
"""

import pytest
import torch

import deepspeed.runtime.zero.muon.kernels  # noqa: F401  (installs the kernels into the math, as the engine does)
from deepspeed.runtime.zero.muon.kernels import symmetric_tiles
from deepspeed.runtime.zero.muon.kernels.symmetric_tiles import whole_symmetric_product, whole_symmetric_supported
from deepspeed.runtime.zero.muon.original_muon import NS_FUNCTIONS

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
KERNEL = torch.cuda.is_available() and whole_symmetric_supported(torch.empty(1, 2048, 2048, device="cuda",
                                                                             dtype=torch.float16))
needs_kernel = pytest.mark.skipif(not KERNEL, reason="the triangular kernel needs a Hopper GPU and Triton")


def gram_input(count, m, K, layout, device, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    if layout == "rows":
        X = torch.randn(count, m, K, generator=generator)
    else:  # the wide view of a tall matrix: each matrix stored as (K, m)
        X = torch.randn(count, K, m, generator=generator).mT
    return (X / K**0.5).to(device=device, dtype=dtype)


def commuting_symmetric(count, m, device, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    G = torch.randn(count, m, 2 * m, generator=generator) / (2 * m)**0.5
    S = G @ G.mT
    return S.to(device=device, dtype=dtype), (S @ S - 0.5 * S).to(device=device, dtype=dtype)


def size(device):
    """m: the kernel's (from MIN_SIZE) on a GPU, the fallbacks' at a size a CPU affords."""
    return symmetric_tiles.MIN_SIZE if device == "cuda" else 512


def max_relative_error(got, reference):
    return ((got.float() - reference).abs().max() / reference.abs().max()).item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["rows", "cols"])
def test_x_xt_is_the_whole_product(device, dtype, layout):
    m = size(device)
    X = gram_input(3, m, m + 256, layout, device, dtype)
    out = torch.full((3, m, m), float("nan"), device=device, dtype=dtype)
    assert whole_symmetric_product(X, X, out) is out
    reference = X.float() @ X.float().mT
    assert max_relative_error(out, reference) <= 2 * max(max_relative_error(torch.bmm(X, X.mT), reference), 1e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_products_with_addends_and_diagonal(device, dtype):
    m = size(device)
    S, P = commuting_symmetric(2, m, device, dtype)
    D, E = commuting_symmetric(2, m, device, dtype, seed=1)
    out = torch.empty_like(S)
    whole_symmetric_product(P, S, out, alpha=0.5, addend=D, beta=-1.5, addend2=E, beta2=0.25, gamma=3.0)
    reference = 0.5 * P.float() @ S.float() - 1.5 * D.float() + 0.25 * E.float() + 3.0 * torch.eye(m, device=device)
    assert max_relative_error(out, reference) < (5e-3 if dtype == torch.float16 else 2e-2)
    # The addend's own memory as the result (the Gram iteration's P R into R is not, but W's update may be).
    in_place = D.clone()
    whole_symmetric_product(P, S, in_place, alpha=0.5, addend=in_place, beta=-1.5)
    reference = 0.5 * P.float() @ S.float() - 1.5 * D.float()
    assert max_relative_error(in_place, reference) < (5e-3 if dtype == torch.float16 else 2e-2)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["rows", "cols"])
def test_the_kernel_runs_for_the_engine_s_operands_and_mirrors_every_tile(dtype, layout):
    """The operands the symmetric iteration hands it (a batch of 2048-row matrices, rows or columns contiguous);
    each tile below the diagonal is the transpose of the one above it, bit for bit."""
    X = gram_input(2, 2048, 1024, layout, "cuda", dtype)
    out = torch.full((2, 2048, 2048), float("nan"), device="cuda", dtype=dtype)
    assert symmetric_tiles._launch(X, X, out, 1.0, None, 0.0, None, 0.0, 0.0)
    assert torch.equal(out.tril(-1), out.triu(1).mT)
    reference = X.float() @ X.float().mT
    assert max_relative_error(out, reference) <= 2 * max_relative_error(torch.bmm(X, X.mT), reference)


@needs_kernel
@pytest.mark.parametrize("shape", [(4, 2048, 4096), (2, 6144, 2048), (2, 2048, 2048)], ids=str)
def test_newton_schulz_with_the_kernel_equals_it_on_the_upper_blocks(shape, monkeypatch):
    """The whole "gram_sym" call with the triangular kernel and with cuBLAS's upper blocks (DS_MUON_TRIANGULAR=0):
    wide matrices (the Gram iteration in fp16, one of them tall) and a square (the standard iteration in bf16) agree
    to rounding, and the kernel's result is as close to the fp32 iteration."""
    G = torch.randn(shape, generator=torch.Generator().manual_seed(0)).cuda()
    with_kernel = NS_FUNCTIONS["gram_sym"](G, dtype=torch.bfloat16).float()
    monkeypatch.setenv(symmetric_tiles.ENV_SWITCH, "0")
    on_blocks = NS_FUNCTIONS["gram_sym"](G, dtype=torch.bfloat16).float()
    fp32 = NS_FUNCTIONS["standard"](G, dtype=torch.float32)
    assert (with_kernel - on_blocks).norm() / on_blocks.norm() < (5e-3 if shape[1] != shape[2] else 2e-2)
    assert (with_kernel - fp32).norm() / fp32.norm() <= 1.05 * (on_blocks - fp32).norm() / fp32.norm() + 1e-4


@pytest.mark.parametrize("value", ["false", "off", " 0"])
def test_an_unknown_switch_value_is_refused_by_name(monkeypatch, value):
    """On every machine, before any Newton-Schulz work: the switch is read as 1 or 0 only."""
    monkeypatch.setenv(symmetric_tiles.ENV_SWITCH, value)
    with pytest.raises(ValueError, match=f"{symmetric_tiles.ENV_SWITCH}=.*expected 1 .* or 0"):
        NS_FUNCTIONS["gram_sym"](torch.randn(64, 128), dtype=torch.float32)
