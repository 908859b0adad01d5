"""Which parameters Muon takes: the default "hidden" rule, upstream's name rule, the user's own tags, the log line."""

import logging

import pytest
import torch

import deepspeed
from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
from deepspeed.runtime.zero.muon.per_head import head_count, tag_attention_heads


class GPT2Like(torch.nn.Module):
    """GPT-2's names (wte, wpe: no "embed" in them), a tied head, a LayerNorm and two hidden matrices."""

    def __init__(self, vocab=50, dim=8):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, dim)
        self.wpe = torch.nn.Embedding(16, dim)
        self.attn = torch.nn.Linear(dim, 3 * dim)
        self.mlp = torch.nn.Linear(dim, dim, bias=False)
        self.ln_f = torch.nn.LayerNorm(dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight


class WithOutputEmbeddings(torch.nn.Module):
    """An untied head of another name that the model reports, as Hugging Face models do."""

    def __init__(self, vocab=50, dim=8):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, dim)
        self.block = torch.nn.Linear(dim, dim)
        self.output = torch.nn.Linear(dim, vocab, bias=False)
        self.classifier = torch.nn.Linear(dim, 3)

    def get_output_embeddings(self):
        return self.output


class TopKRouter(torch.nn.Module):
    """A router as transformers names them (class name ending in Router): a matrix [experts, dim] and a bias."""

    def __init__(self, experts, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(experts, dim))
        self.bias = torch.nn.Parameter(torch.zeros(experts))


class FusedExperts(torch.nn.Module):
    """transformers 5's fused experts: [experts, 2 * intermediate, dim] and [experts, dim, intermediate]."""

    def __init__(self, experts, dim, intermediate):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.zeros(experts, 2 * intermediate, dim))
        self.down_proj = torch.nn.Parameter(torch.zeros(experts, dim, intermediate))


class TinyMoE(torch.nn.Module):
    """Embedding, attention, one MoE block (router + 4 fused experts), a norm and an untied head."""

    def __init__(self, vocab=50, dim=8, experts=4, intermediate=6):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, dim)
        self.attn = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.gate = TopKRouter(experts, dim)
        self.experts = FusedExperts(experts, dim, intermediate)
        self.norm = torch.nn.LayerNorm(dim, bias=False)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)


def muon_names(model):
    return sorted(name for name, p in model.named_parameters() if p.use_muon)


def test_hidden_rule_gives_embeddings_head_and_vectors_to_adam():
    model = GPT2Like()
    split = deepspeed.tag_muon_params(model)
    assert muon_names(model) == ["attn.weight", "mlp.weight"]
    reasons = {name: reason for name, _, reason in split.adam}
    assert reasons == {"wte.weight": "embedding", "wpe.weight": "embedding", "attn.bias": "vector",
                       "ln_f.weight": "vector", "ln_f.bias": "vector"}
    assert split.summary("hidden") == ("Muon param split (hidden): Muon 2 tensors (256 params), Adam 5 tensors "
                                       "(568 params): embedding 2 (528), vector 3 (40)")


@pytest.mark.parametrize("rule", ["hidden", "upstream"])
def test_moe_router_and_experts_go_to_muon_and_the_log_line_counts_their_matrices(rule):
    model = TinyMoE()
    split = deepspeed.tag_muon_params(model, rule)
    # The router's weight is a hidden matrix; its bias a vector (Adam); each fused tensor is 4 matrices.
    assert muon_names(model) == ["attn.weight", "experts.down_proj", "experts.gate_up_proj", "gate.weight"]
    assert split.routers == ["gate.weight"]
    assert split.matrices == {"attn.weight": 1, "gate.weight": 1, "experts.gate_up_proj": 4, "experts.down_proj": 4}
    adam = ("embedding 1 (400), head 1 (400), vector 2 (12)" if rule == "hidden" else
            "named embed or lm_head 2 (800), vector 2 (12)")
    assert split.summary(rule) == (f"Muon param split ({rule}): Muon 4 tensors = 10 matrices (800 params; fused "
                                   f"experts 2 tensors = 8 matrices, routers 1), Adam 4 tensors (812 params): {adam}")


class FusedExpertsWithBiases(FusedExperts):
    """GPT-OSS's fused experts: a bias vector per expert, stored as one [experts, out] parameter each."""

    def __init__(self, experts, dim, intermediate):
        super().__init__(experts, dim, intermediate)
        self.gate_up_proj_bias = torch.nn.Parameter(torch.zeros(experts, 2 * intermediate))
        self.down_proj_bias = torch.nn.Parameter(torch.zeros(experts, dim))


class PerHeadBias(torch.nn.Module):
    """A per-head bias [heads, head_dim] named "bias" (XLNet and Funnel keep theirs so)."""

    def __init__(self, heads=2, head_dim=4):
        super().__init__()
        self.proj = torch.nn.Linear(heads * head_dim, heads * head_dim, bias=False)
        self.bias = torch.nn.Parameter(torch.zeros(heads, head_dim))


class ExpertNorm(torch.nn.Module):
    """One RMS norm scale per expert, [experts, dim] (Ergo's ErgoExpertNorm)."""

    def __init__(self, experts=4, dim=8):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(experts, dim))


def test_norm_scales_of_two_dims_go_to_adam():
    model = TinyMoE()
    model.expert_norm = ExpertNorm()
    split = deepspeed.tag_muon_params(model)
    assert not model.expert_norm.weight.use_muon
    assert ("expert_norm.weight", 32, "stacked norm") in split.adam


def test_a_state_space_mixers_decay_rates_and_skip_scales_go_to_adam():
    """Jamba's Mamba mixer (transformers 5.25): A_log [channels, state] and D are element-wise; its projections are
    matrices; its depthwise conv kernel [channels, 1, width] is a batch of matrices as any 3-D tensor."""
    import transformers

    config = transformers.JambaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                      num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
                                      attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4, mamba_d_conv=4,
                                      mamba_expand=2, mamba_dt_rank=4)
    model = transformers.AutoModelForCausalLM.from_config(config)
    split = deepspeed.tag_muon_params(model)
    mixer = {name.removeprefix("model.layers.0.mamba."): p.use_muon for name, p in model.named_parameters()
             if name.startswith("model.layers.0.mamba.") and p.ndim >= 2}
    assert mixer == {"A_log": False, "conv1d.weight": True, "in_proj.weight": True, "x_proj.weight": True,
                     "dt_proj.weight": True, "out_proj.weight": True}
    assert ("model.layers.0.mamba.A_log", 256, "state-space decay") in split.adam
    assert model.model.layers[1].feed_forward.experts.gate_up_proj.use_muon


@pytest.mark.parametrize("rule", ["hidden", "upstream"])
def test_biases_of_two_dims_are_a_bias_per_expert_or_head(rule):
    """Orthogonalising [experts, out] as one matrix would tie each expert's bias update to the others' gradients:
    the default rule gives every bias to Adam whatever its dims; upstream's rule goes by dims and names only."""
    model = TinyMoE()
    model.experts = FusedExpertsWithBiases(4, 8, 6)
    model.heads = PerHeadBias()
    split = deepspeed.tag_muon_params(model, rule)
    biases = ["experts.down_proj_bias", "experts.gate_up_proj_bias", "heads.bias"]
    matrices = ["attn.weight", "experts.down_proj", "experts.gate_up_proj", "gate.weight", "heads.proj.weight"]
    assert muon_names(model) == (matrices if rule == "hidden" else sorted(matrices + biases))
    if rule == "hidden":
        assert {name: reason for name, _, reason in split.adam if name in biases} == dict.fromkeys(biases,
                                                                                                   "stacked bias")
        assert "stacked bias 3 (88)" in split.summary(rule)


class RowStackedExperts(torch.nn.Module):
    """DBRX's experts: each weight is [experts * ffn, dim], expert e's matrix its rows e * ffn to (e + 1) * ffn."""

    def __init__(self, experts=4, dim=8, ffn=6):
        super().__init__()
        self.moe_num_experts = experts
        self.w1 = torch.nn.Parameter(torch.zeros(experts * ffn, dim))
        self.w2 = torch.nn.Parameter(torch.zeros(experts * ffn, dim))


class RouterWithCount(torch.nn.Module):
    """A router that says its expert count: its weight [experts, dim] has one row per expert, a matrix of its own."""

    def __init__(self, experts=4, dim=8):
        super().__init__()
        self.num_experts = experts
        self.weight = torch.nn.Parameter(torch.zeros(experts, dim))


@pytest.mark.parametrize("rule", ["hidden", "upstream"])
def test_experts_stacked_by_rows_are_orthogonalised_one_by_one(rule):
    """Orthogonalised whole, DBRX's [experts * ffn, dim] would tie each expert's update to the others' gradients:
    the split gives it a head count of one block per expert, under both rules; a router keeps its weight whole."""
    model = TinyMoE()
    model.experts = RowStackedExperts()
    model.router = RouterWithCount()
    split = deepspeed.tag_muon_params(model, rule)
    heads = {name: getattr(p, "muon_num_heads", None) for name, p in model.named_parameters() if p.use_muon}
    assert heads == {"attn.weight": None, "gate.weight": None, "experts.w1": 4, "experts.w2": 4,
                     "router.weight": None}
    assert split.matrices["experts.w1"] == split.matrices["experts.w2"] == 4
    assert "fused experts 2 tensors = 8 matrices" in split.summary(rule)
    assert {name: head_count(p, name) for name, p in model.named_parameters() if p.use_muon}["experts.w1"] == 4
    # Tagged again (a second initialize), the count is derived again, not kept as if a user had set it.
    model.experts.moe_num_experts = 2
    deepspeed.tag_muon_params(model, rule)
    assert model.experts.w1.muon_num_heads == 2


def test_a_head_count_the_user_set_on_stacked_experts_wins(caplog):
    model = TinyMoE()
    model.experts = RowStackedExperts()
    model.experts.w2.muon_num_heads = 1  # keep it whole
    deepspeed.tag_muon_params(model)
    assert model.experts.w1.muon_num_heads == 4 and model.experts.w2.muon_num_heads == 1
    # The per-head tagging reports them apart from attention heads, and per_head_muon finds no head in them.
    logger = logging.getLogger("DeepSpeed")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="DeepSpeed"):
            assert tag_attention_heads(model) == {}
    finally:
        logger.removeHandler(caplog.handler)
    assert "Muon orthogonalises 1 matrices per expert: experts.w1 (4 experts of 6 rows)" in caplog.text
    with pytest.raises(ValueError, match="per_head_muon is true, but no Muon matrix can be orthogonalised per head"):
        tag_attention_heads(model, per_head_muon=True)


def test_a_router_tagged_for_adam_is_not_counted_among_muons_routers():
    model = TinyMoE()
    model.gate.weight.use_muon = False
    split = deepspeed.tag_muon_params(model)
    assert split.routers == [] and ("gate.weight", 32, "tagged use_muon=False") in split.adam
    assert "routers" not in split.summary("hidden")


def test_the_models_own_output_embeddings_are_the_head():
    model = WithOutputEmbeddings()
    deepspeed.tag_muon_params(model)
    # The reported head goes to Adam; a classifier of another name is a matrix like any other.
    assert muon_names(model) == ["block.weight", "classifier.weight"]


def test_upstream_rule_goes_by_name():
    model = GPT2Like()
    deepspeed.tag_muon_params(model, "upstream")
    # wte/wpe hold no "embed": upstream gives them (and the tied head with wte) to Muon.
    assert muon_names(model) == ["attn.weight", "mlp.weight", "wpe.weight", "wte.weight"]


@pytest.mark.parametrize("rule", ["hidden", "upstream"])
def test_the_users_tags_win(rule):
    model = GPT2Like()
    model.attn.weight.use_muon = False
    model.wpe.weight.use_muon = True
    split = deepspeed.tag_muon_params(model, rule)
    assert not model.attn.weight.use_muon and model.wpe.weight.use_muon
    assert ("attn.weight", 24 * 8, "tagged use_muon=False") in split.adam


def test_frozen_parameters_are_tagged_but_not_counted():
    model = GPT2Like()
    model.mlp.weight.requires_grad_(False)
    split = deepspeed.tag_muon_params(model)
    assert model.mlp.weight.use_muon and [name for name, _ in split.muon] == ["attn.weight"]


def test_unknown_rule_is_refused_by_name():
    config = {"train_batch_size": 1, "optimizer": {"type": "Muon", "params": {"param_split": "all"}}}
    message = r"param_split must be one of \['hidden', 'upstream'\], got 'all'"
    with pytest.raises(DeepSpeedConfigError, match=r"optimizer.params." + message):
        DeepSpeedConfig(config)
    with pytest.raises(ValueError, match=message):
        deepspeed.tag_muon_params(GPT2Like(), "all")


def test_initialize_logs_the_split_once(caplog):
    config = {"train_batch_size": 1, "optimizer": {"type": "Muon", "params": {"param_split": "upstream"}}}
    logger = logging.getLogger("DeepSpeed")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="DeepSpeed"):
            deepspeed.set_optimizer_flags(DeepSpeedConfig(config), GPT2Like())
    finally:
        logger.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if "Muon param split" in r.getMessage()]
    assert len(lines) == 1 and lines[0].endswith(
        "Muon param split (upstream): Muon 4 tensors (784 params), Adam 3 tensors (40 params): vector 3 (40)")
