"""trainer/megatron/llama_names.py: Hugging Face Llama tensors to megatron's fused, sharded ones
and back, exactly, at every tensor-parallel size the heads allow; and what it refuses."""

from __future__ import annotations

import pytest
import torch

from trainer.megatron import llama_names as names

SHAPE = names.LlamaShape(num_heads=8, num_kv_heads=4, head_dim=16, hidden_size=128)
LAYER = "decoder.layers.3."
HF = {
    "model.layers.3.self_attn.q_proj.weight": torch.randn(8 * 16, 128),
    "model.layers.3.self_attn.k_proj.weight": torch.randn(4 * 16, 128),
    "model.layers.3.self_attn.v_proj.weight": torch.randn(4 * 16, 128),
    "model.layers.3.mlp.gate_proj.weight": torch.randn(256, 128),
    "model.layers.3.mlp.up_proj.weight": torch.randn(256, 128),
    "model.layers.3.mlp.down_proj.weight": torch.randn(128, 256),
}
PARAMS = {  # megatron name -> partition dim (None: replicated)
    LAYER + names.QKV: 0,
    LAYER + names.FC1: 0,
    LAYER + "mlp.linear_fc2.weight": 1,
}


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", list(PARAMS))
def test_fuse_shard_unshard_split_round_trips(name, tp):
    hf = [HF[n] for n in names.hf_names(name)]
    full = names.fuse(name, hf, SHAPE)
    shards = [names.shard(name, full, PARAMS[name], r, tp) for r in range(tp)]
    back = names.split(name, names.unshard(name, shards, PARAMS[name]), SHAPE)
    assert all(torch.equal(a, b) for a, b in zip(back, hf, strict=True))


def test_a_qkv_shard_holds_whole_query_groups():
    """Rank r of 2 holds query groups 2r and 2r+1: each group's query heads, then its key and value head."""
    full = names.fuse(LAYER + names.QKV, [HF[n] for n in names.hf_names(LAYER + names.QKV)], SHAPE)
    second = names.shard(LAYER + names.QKV, full, 0, 1, 2)
    group = (SHAPE.heads_per_group + 2) * SHAPE.head_dim
    q = HF["model.layers.3.self_attn.q_proj.weight"]
    k = HF["model.layers.3.self_attn.k_proj.weight"]
    g2 = second[:group]  # query group 2
    assert torch.equal(g2[: 2 * 16], q[4 * 16 : 6 * 16]) and torch.equal(g2[2 * 16 : 3 * 16], k[2 * 16 : 3 * 16])


def test_an_fc1_shard_is_its_gate_slice_over_its_up_slice():
    full = names.fuse(
        LAYER + names.FC1, [HF["model.layers.3.mlp.gate_proj.weight"], HF["model.layers.3.mlp.up_proj.weight"]], SHAPE
    )
    first = names.shard(LAYER + names.FC1, full, 0, 0, 2)
    assert torch.equal(first[:128], HF["model.layers.3.mlp.gate_proj.weight"][:128])
    assert torch.equal(first[128:], HF["model.layers.3.mlp.up_proj.weight"][:128])
    # Concatenating the shards as they come (a plain gather) would not be the fused tensor.
    naive = torch.cat([first, names.shard(LAYER + names.FC1, full, 0, 1, 2)])
    assert not torch.equal(naive, full)


def test_stage_layer_numbers_become_global():
    assert names.global_name("decoder.layers.0.mlp.linear_fc2.weight", 2) == "decoder.layers.2.mlp.linear_fc2.weight"
    assert names.global_name("output_layer.weight", 2) == "output_layer.weight"
    assert names.hf_names("decoder.layers.2.mlp.linear_fc2.weight") == ["model.layers.2.mlp.down_proj.weight"]


def test_a_parameter_without_a_llama_name_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"'decoder.layers.0.self_attention.linear_qkv.bias' has no Hugging Face"):
        names.hf_names("decoder.layers.0.self_attention.linear_qkv.bias")
