"""Straightforward fp64 references for the Muon math, written independently of deepspeed's code."""

import math

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz_fp64(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The textbook quintic on the wide orientation, in fp64."""
    if G.size(-2) > G.size(-1):
        return newton_schulz_fp64(G.mT, steps).mT
    a, b, c = NS_COEFFICIENTS
    X = G.double()
    X = X / (torch.linalg.matrix_norm(X, keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X


def shape_factor(rows, cols, adjust_lr_fn="original"):
    """torch.optim.Muon's learning-rate adjustment for a rows x cols update."""
    if adjust_lr_fn == "original":
        return math.sqrt(max(1.0, rows / cols))
    assert adjust_lr_fn == "match_rms_adamw"
    return 0.2 * math.sqrt(max(rows, cols))


def muon_update_fp64(grad, momentum, beta, nesterov=True, ns_steps=5, num_heads=1, adjust_lr_fn="original"):
    """Returns (update, new_momentum) in fp64 without touching the inputs.

    With num_heads > 1, each head's block of rows (rows / num_heads consecutive rows) is orthogonalised and scaled
    as a matrix of its own, one block at a time.
    """
    g = grad.double()
    m = beta * momentum.double() + (1 - beta) * g
    direction = (1 - beta) * g + beta * m if nesterov else m
    matrix = direction.reshape(direction.size(0), -1) if direction.ndim == 4 else direction
    rows, cols = matrix.shape[-2:]
    head_rows = rows // num_heads
    blocks = []
    for head in range(num_heads):
        block = matrix[..., head * head_rows:(head + 1) * head_rows, :]
        blocks.append(newton_schulz_fp64(block, ns_steps) * shape_factor(head_rows, cols, adjust_lr_fn))
    return torch.cat(blocks, dim=-2).reshape(grad.shape), m
