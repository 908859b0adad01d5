"""A GPT-2-small-like decoder for the benchmarks (nanoGPT's shape, synthetic tokens), dense or mixture-of-experts.

Parameter names follow the Muon tagging rule of `deepspeed.tag_muon_params`: the token and position
tables are called `embed_*` and the tied output head `lm_head`, so Muon gets exactly the hidden matrices
(attention qkv and projection, MLP fc and projection) and Adam everything else.

With `n_experts` > 0 every block's MLP is a mixture of experts as transformers 5 stores them: a router (a matrix
[experts, d_model], Muon's under both split rules) and fused expert weights [experts, out, in] (`experts_fc`,
`experts_proj`), each token sent to its `top_k` experts. Plain torch, so upstream releases run it too.
"""

import math
from dataclasses import KW_ONLY, dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Model size. The defaults are GPT-2 small (124M parameters with the tied head)."""

    n_layer: int = 12
    d_model: int = 768
    n_head: int = 12
    seq_len: int = 1024
    vocab_size: int = 50304
    # The options below are keyword-only: a positional size list cannot shift into them.
    _: KW_ONLY
    # Recompute each block's activations in the backward (torch.utils.checkpoint, non-reentrant) instead of keeping
    # them: only the blocks' inputs stay alive between the forward and the backward.
    activation_checkpointing: bool = False
    n_experts: int = 0  # 0: a dense MLP; else a mixture of this many experts per block
    top_k: int = 2  # experts per token (with n_experts > 0)


# The sizes the published tables are measured at, named once: each benchmark's size flag maps its names onto these.
GPT2_SMALL = GPTConfig()  # 124M parameters with the tied head
GPT_1_1B = GPTConfig(n_layer=20, d_model=2048, n_head=16)  # 1,112,289,280 parameters, 80 Muon matrices
GPT_7B = GPTConfig(n_layer=32, d_model=4096, n_head=32)


def size_flags(cfg: GPTConfig) -> dict:
    """A size as the benchmarks' size flags (--layers, --d-model, --heads, --seq-len, --vocab) spell it."""
    return {"layers": cfg.n_layer, "d_model": cfg.d_model, "heads": cfg.n_head, "seq_len": cfg.seq_len,
            "vocab": cfg.vocab_size}


class CausalSelfAttention(nn.Module):

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"d_model ({cfg.d_model}) must be divisible by n_head ({cfg.n_head})")
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(batch, seq, width))


class MLP(nn.Module):

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class MoEMLP(nn.Module):
    """Top-k routed experts with fused weights: `experts_fc` [experts, 4 * d_model, d_model] and `experts_proj`
    [experts, d_model, 4 * d_model], no biases (a per-expert bias would be a 2-D tensor Muon takes for a matrix).

    Each token goes to the `top_k` experts its router scores highest, weighted by the softmax of those scores;
    each expert runs on its tokens only (Mixtral's eager loop), so the work per token is that of top_k dense MLPs.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if not 1 <= cfg.top_k <= cfg.n_experts:
            raise ValueError(f"top_k ({cfg.top_k}) must be between 1 and n_experts ({cfg.n_experts})")
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts_fc = nn.Parameter(torch.empty(cfg.n_experts, 4 * cfg.d_model, cfg.d_model))
        self.experts_proj = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_model, 4 * cfg.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.size(-1))
        weights, chosen = torch.topk(self.router(tokens), self.top_k, dim=-1)
        weights = torch.softmax(weights.float(), dim=-1).to(tokens.dtype)
        out = torch.zeros_like(tokens)
        for expert in range(self.experts_fc.size(0)):
            token_index, slot = torch.where(chosen == expert)
            if token_index.numel() == 0:
                continue
            hidden = F.gelu(tokens[token_index] @ self.experts_fc[expert].T, approximate="tanh")
            contribution = (hidden @ self.experts_proj[expert].T) * weights[token_index, slot, None]
            out.index_add_(0, token_index, contribution.to(out.dtype))
        return out.view_as(x)


class Block(nn.Module):

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MoEMLP(cfg) if cfg.n_experts else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer; `forward(idx, targets)` returns the mean cross-entropy (fp32)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.embed_positions = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # GPT-2 ties the output head to the token table; named_parameters() lists it once, as embed_tokens.
        self.lm_head.weight = self.embed_tokens.weight
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("experts_proj"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
            elif name.endswith("experts_fc"):
                nn.init.normal_(param, mean=0.0, std=0.02)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.embed_tokens(idx) + self.embed_positions(positions)
        for block in self.blocks:
            if self.cfg.activation_checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def is_hidden_matrix(name: str, param: torch.Tensor) -> bool:
    """The Muon rule of `deepspeed.tag_muon_params`: >= 2 dims, not an embedding, not the head."""
    lowered = name.lower()
    return param.ndim >= 2 and "embed" not in lowered and "lm_head" not in lowered


def hidden_matrix_shapes(model: nn.Module) -> list:
    """Shapes of the matrices Muon orthogonalises, in the model's parameter order: a fused expert tensor
    [experts, out, in] is `experts` matrices of (out, in), as Newton-Schulz sees it. (Under ZeRO the engine keeps a
    fused tensor whole on one owner, so with several ranks an owner split of these matrices is a lower bound.)"""
    shapes = []
    for name, p in model.named_parameters():
        if is_hidden_matrix(name, p):
            shapes += [tuple(p.shape[-2:])] * math.prod(p.shape[:-2]) if p.ndim == 3 else [tuple(p.shape)]
    return shapes


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
