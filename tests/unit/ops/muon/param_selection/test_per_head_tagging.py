"""per_head_muon's tagging rules: which matrices are split by heads, with which count, and the errors.

Rules: the weights of q/k/v projections (module names q_proj, k_proj, v_proj, query, key, value, wq, wk, wv) and
of MLA up-projections (q_b_proj, kv_b_proj) get a head count from the model's config (num_key_value_heads for k
and v); output projections and fused QKV matrices stay whole; a muon_num_heads / muon_head_dim the user set wins.
"""

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import deepspeed
from deepspeed.runtime.zero.muon.per_head import head_count, tag_attention_heads
from deepspeed.utils.logging import logger

D = 32


class Attention(nn.Module):

    def __init__(self, names=("q_proj", "k_proj", "v_proj", "o_proj"), rows=(D, D // 2, D // 2, D)):
        super().__init__()
        for name, out in zip(names, rows):
            self.add_module(name, nn.Linear(D, out, bias=False))


class Model(nn.Module):
    """Two attention layers, a fused-QKV layer, an MLP and an embedding, with a head config (or none)."""

    def __init__(self, config=None, attention=Attention):
        super().__init__()
        if config is not None:
            self.config = config
        self.embed_tokens = nn.Embedding(10, D)
        self.layers = nn.ModuleList([nn.ModuleDict({"self_attn": attention(), "mlp": nn.Linear(D, 4 * D)})
                                     for _ in range(2)])
        self.fused = nn.ModuleDict({"qkv_proj": nn.Linear(D, 3 * D), "c_attn": nn.Linear(D, 3 * D)})


def tagged_model(config=None, attention=Attention):
    model = Model(config, attention)
    deepspeed.tag_muon_params(model)
    return model


def llama_config(**overrides):
    return SimpleNamespace(**{"hidden_size": D, "num_attention_heads": 4, "num_key_value_heads": 2, **overrides})


def test_grouped_query_attention_is_tagged_and_the_rest_stays_whole():
    model = tagged_model(llama_config())
    tagged = tag_attention_heads(model, True)
    expected = {}
    for layer in range(2):
        prefix = f"layers.{layer}.self_attn"
        expected.update({f"{prefix}.q_proj.weight": 4, f"{prefix}.k_proj.weight": 2, f"{prefix}.v_proj.weight": 2})
    assert tagged == expected
    whole = [name for name, p in model.named_parameters() if p.use_muon and name not in expected]
    assert whole == ["layers.0.self_attn.o_proj.weight", "layers.0.mlp.weight", "layers.1.self_attn.o_proj.weight",
                     "layers.1.mlp.weight", "fused.qkv_proj.weight", "fused.c_attn.weight"]
    assert all(head_count(p) == 1 for name, p in model.named_parameters() if name in whole)


def test_the_tagging_is_logged():
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        tag_attention_heads(tagged_model(llama_config()), True)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    messages = [record.getMessage() for record in records]
    assert any("Muon orthogonalises 6 matrices per head: layers.0.self_attn.q_proj.weight (4 heads of 8 rows), "
               "layers.0.self_attn.k_proj.weight (2 heads of 8 rows)" in message for message in messages), messages


@pytest.mark.parametrize("config,expected", [
    # no num_key_value_heads: k/v have the rows of head_dim (hidden_size / heads) each, like q
    (SimpleNamespace(hidden_size=D, num_heads=4), {"q": 4, "k": 2, "v": 2}),
    # a head_dim of its own wins over hidden_size / heads for k and v
    (SimpleNamespace(n_embd=D, n_head=4, head_dim=4), {"q": 4, "k": 4, "v": 4}),
    # neither head_dim nor a hidden size: every projection takes the query count
    (SimpleNamespace(n_heads=2), {"q": 2, "k": 2, "v": 2}),
    # head_dim alone: rows / head_dim
    (SimpleNamespace(head_dim=8), {"q": 4, "k": 2, "v": 2}),
    # multimodal: the language model's counts are in text_config
    (SimpleNamespace(text_config=SimpleNamespace(num_attention_heads=4, num_key_value_heads=1),
                     vision_config=SimpleNamespace(num_attention_heads=16)), {"q": 4, "k": 1, "v": 1}),
    # a config given as a dict
    ({"num_attention_heads": 8, "num_key_value_heads": 4}, {"q": 8, "k": 4, "v": 4}),
])
def test_head_counts_from_the_config(config, expected):
    model = tagged_model(config)
    tag_attention_heads(model, True)
    attention = model.layers[1]["self_attn"]
    counts = {name: head_count(getattr(attention, f"{name}_proj").weight) for name in "qkv"}
    assert counts == expected


def test_other_projection_names():

    def bert_attention():
        return Attention(("query", "key", "value", "dense"))

    model = tagged_model(SimpleNamespace(num_attention_heads=4), bert_attention)
    assert sorted(tag_attention_heads(model, True).values()) == [4, 4, 4, 4, 4, 4]
    assert head_count(model.layers[0]["self_attn"].dense.weight) == 1

    def meta_attention():
        return Attention(("wq", "wk", "wv", "wo"))

    model = tagged_model(SimpleNamespace(dim=D, n_heads=8), meta_attention)
    assert sorted(tag_attention_heads(model, True).values()) == [4, 4, 4, 4, 8, 8]


def test_multi_head_latent_attention_up_projections_take_the_query_count():
    """MLA's heads are q_head_dim (nope + rope) or nope + v rows: not head_dim, so the count decides the rows."""
    heads, nope, rope, v_dim, q_rank, kv_rank = 4, 6, 2, 5, 12, 8

    def mla():
        return Attention(("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
                         (q_rank, heads * (nope + rope), kv_rank + rope, heads * (nope + v_dim), D))

    model = Model(SimpleNamespace(num_attention_heads=heads, num_key_value_heads=heads, head_dim=rope), mla)
    # kv_b_proj maps from the small latent: tall heads of 11 x 8 (its input here is D wide; the shape is what counts)
    model.layers[0]["self_attn"].kv_b_proj = nn.Linear(kv_rank, heads * (nope + v_dim), bias=False)
    deepspeed.tag_muon_params(model)
    tagged = tag_attention_heads(model, True)
    assert tagged == {f"layers.{layer}.self_attn.{name}.weight": heads
                      for layer in range(2) for name in ("q_b_proj", "kv_b_proj")}
    # A plain q_proj in an MLA model: heads * (nope + rope) rows, resolved by the count, not by head_dim
    model = tagged_model(SimpleNamespace(num_attention_heads=heads, head_dim=rope),
                         lambda: Attention(("q_proj", ), (heads * (nope + rope), )))
    assert set(tag_attention_heads(model, True).values()) == {heads}


def test_user_attributes_win_and_work_without_per_head_muon():
    model = tagged_model(llama_config())
    attention = model.layers[0]["self_attn"]
    attention.q_proj.weight.muon_num_heads = 1    # keep this q whole
    attention.k_proj.weight.muon_head_dim = 4     # 16 rows in 4 heads instead of 2
    attention.o_proj.weight.muon_num_heads = 2    # an output projection, because the user says so
    tagged = tag_attention_heads(model, True)
    prefix = "layers.0.self_attn"
    assert f"{prefix}.q_proj.weight" not in tagged
    assert tagged[f"{prefix}.k_proj.weight"] == 4 and tagged[f"{prefix}.o_proj.weight"] == 2
    assert tagged["layers.1.self_attn.q_proj.weight"] == 4
    # Without per_head_muon only the user's attributes count.
    assert tag_attention_heads(model, False) == {f"{prefix}.k_proj.weight": 4, f"{prefix}.o_proj.weight": 2}


def test_derived_counts_are_derived_again():
    model = tagged_model(llama_config())
    assert len(tag_attention_heads(model, True)) == 6
    assert tag_attention_heads(model, False) == {}
    model.config = llama_config(num_attention_heads=2, num_key_value_heads=1)
    assert set(tag_attention_heads(model, True).values()) == {2}


def test_only_trainable_muon_matrices_are_tagged():
    model = Model(llama_config())
    model.layers[0]["self_attn"].q_proj.weight.use_muon = False
    model.layers[1]["self_attn"].q_proj.weight.requires_grad_(False)
    deepspeed.tag_muon_params(model)
    tagged = tag_attention_heads(model, True)
    assert not any("q_proj" in name for name in tagged) and len(tagged) == 4


@pytest.mark.parametrize("model,message", [
    (lambda: tagged_model(None), r"per_head_muon is true, but no Muon matrix can be orthogonalised per head: the "
                                 r"model has no `config` attribute to read head counts from\. It tags the weights"),
    (lambda: tagged_model(SimpleNamespace(hidden_size=D)), r"model\.config has none of num_heads, "
                                                           r"num_attention_heads, n_head, n_heads, "
                                                           r"num_key_value_heads, head_dim"),
    (lambda: tagged_model(SimpleNamespace(n_head=4), lambda: Attention(("c_attn", "c_proj"), (3 * D, D))),
     r"no Muon matrix is the weight of a module named q_proj, query, wq, k_proj"),
    (lambda: tagged_model(SimpleNamespace(num_heads=1)), r"get no head count above 1 from the config "
                                                         r"\(model\.config\.num_heads = 1\)"),
])
def test_nothing_to_tag_is_an_error_that_says_why(model, message):
    with pytest.raises(ValueError, match=message):
        tag_attention_heads(model(), True)


def test_impossible_head_counts_are_errors():
    with pytest.raises(ValueError, match=r"per_head_muon: layers\.0\.self_attn\.q_proj\.weight \(shape \(32, 32\)\) "
                                         r"has 32 rows, not divisible by its head count "
                                         r"model\.config\.num_attention_heads = 5; set"):
        tag_attention_heads(tagged_model(llama_config(num_attention_heads=5, num_key_value_heads=1)), True)
    with pytest.raises(ValueError, match=r"k_proj\.weight \(shape \(16, 32\)\) has 16 rows, not divisible by the head "
                                         r"size model\.config\.head_dim = 12"):
        tag_attention_heads(tagged_model(SimpleNamespace(num_attention_heads=4, head_dim=12)), True)
    model = tagged_model(llama_config())
    model.layers[0]["self_attn"].o_proj.weight.muon_head_dim = 12
    with pytest.raises(ValueError, match=r"parameter layers\.0\.self_attn\.o_proj\.weight of shape \(32, 32\): "
                                         r"muon_head_dim = 12, but its 32 rows are not divisible by the head size"):
        tag_attention_heads(model, False)
    model.layers[0]["self_attn"].o_proj.weight.muon_head_dim = 8
    model.layers[0]["self_attn"].o_proj.weight.muon_num_heads = 2
    with pytest.raises(ValueError, match=r"muon_num_heads = 2 disagrees with muon_head_dim = 8 \(4 heads of 8 rows\)"):
        tag_attention_heads(model, False)
    with pytest.raises(ValueError, match=r"model\.config\.num_attention_heads must be a positive int, got 0"):
        tag_attention_heads(tagged_model(llama_config(num_attention_heads=0)), True)
    with pytest.raises(ValueError, match=r"optimizer\.params\.per_head_muon must be true or false, got 'yes'"):
        tag_attention_heads(tagged_model(llama_config()), "yes")


def test_head_count_of_an_untagged_tensor_is_one():
    assert head_count(torch.zeros(6, 4)) == 1
