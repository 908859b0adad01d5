"""Straightforward fp64 references for the Muon math, written independently of deepspeed's code."""

import math

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
# The Polar Express paper's five quintics for Muon (Amsel, Persson, Musco, Gower 2025; l = 1e-3, cushion and safety
# factor 0.02), as published with it.
POLAR_EXPRESS_5 = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def newton_schulz_fp64(G: torch.Tensor, steps: int = 5, coefficients: str = "jordan") -> torch.Tensor:
    """The textbook quintic on the wide orientation, in fp64; "polar_express" takes the published five steps."""
    if G.size(-2) > G.size(-1):
        return newton_schulz_fp64(G.mT, steps, coefficients).mT
    if coefficients == "polar_express":
        assert steps == 5, "the reference holds the published five-step schedule only"
        schedule = POLAR_EXPRESS_5
    else:
        schedule = [NS_COEFFICIENTS] * steps
    X = G.double()
    X = X / (torch.linalg.matrix_norm(X, keepdim=True) + 1e-7)
    for a, b, c in schedule:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X


def shape_factor(rows, cols, adjust_lr_fn="original"):
    """torch.optim.Muon's learning-rate adjustment for a rows x cols update."""
    if adjust_lr_fn == "original":
        return math.sqrt(max(1.0, rows / cols))
    assert adjust_lr_fn == "match_rms_adamw"
    return 0.2 * math.sqrt(max(rows, cols))


def muon_update_fp64(grad, momentum, beta, nesterov=True, ns_steps=5, num_heads=1, adjust_lr_fn="original",
                     coefficients="jordan"):
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
        blocks.append(newton_schulz_fp64(block, ns_steps, coefficients) * shape_factor(head_rows, cols, adjust_lr_fn))
    return torch.cat(blocks, dim=-2).reshape(grad.shape), m


def normuon_fp64(orthogonalised, second_moment, beta2=0.95, eps=1e-8):
    """NorMuon's normalisation (Li et al. 2025, Algorithm 1) of one orthogonalised rows x cols block, in fp64.

    v <- beta2 v + (1 - beta2) mean_cols(O * O); Ô = O / (sqrt(v) + eps); returned with Frobenius norm
    sqrt(min(rows, cols)) (the norm of the polar factor: the caller's shape factor then applies as for Muon; with
    match_rms_adamw's 0.2 sqrt(max(rows, cols)) that is the paper's 0.2 sqrt(rows cols) Ô / ||Ô||_F). Returns
    (normalised, new second moment) without touching the inputs.
    """
    o = orthogonalised.double()
    v = beta2 * second_moment.double() + (1 - beta2) * (o * o).mean(dim=-1)
    o_hat = o / (v.sqrt() + eps).unsqueeze(-1)
    rows, cols = o.shape[-2:]
    return o_hat * (math.sqrt(min(rows, cols)) / torch.linalg.matrix_norm(o_hat)), v
