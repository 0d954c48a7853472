"""Hugging Face Llama weights and megatron-core's GPTModel (local spec) weights, both ways
(docs/trainer.md#megatron): which megatron parameter holds which HF tensors, how a
tensor-parallel shard is cut from the full tensor, and how the gathered shards regroup.

The same table as megatron-bridge's Llama mappings: the fused QKV holds, per query group, that
group's query heads then its key and value head; the SwiGLU `linear_fc1` shard of a
tensor-parallel rank is its slice of the gate projection stacked on its slice of the up projection.
Layer numbers here are global (a pipeline stage's local layer i is global layer offset + i).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LlamaShape:
    """What the mapping needs of the model's config."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
DIRECT = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
DIRECT_IN_LAYER = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
QKV, FC1 = "self_attention.linear_qkv.weight", "mlp.linear_fc1.weight"


def hf_names(megatron_name: str) -> list[str]:
    """The HF tensors one megatron parameter (global layer numbers) holds; ValueError for one
    the mapping does not know (a bias, a layer spec other than Llama's)."""
    if megatron_name in DIRECT:
        return [DIRECT[megatron_name]]
    m = _LAYER.fullmatch(megatron_name)
    if m:
        layer, rest = m.groups()
        prefix = f"model.layers.{layer}."
        if rest in DIRECT_IN_LAYER:
            return [prefix + DIRECT_IN_LAYER[rest]]
        if rest == QKV:
            return [prefix + f"self_attn.{p}_proj.weight" for p in "qkv"]
        if rest == FC1:
            return [prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight"]
    raise ValueError(
        f"megatron parameter {megatron_name!r} has no Hugging Face Llama name: the Megatron backend maps "
        "the local Llama spec (RMSNorm, SwiGLU, RoPE, no biases) only"
    )


def fuse(megatron_name: str, hf: list[torch.Tensor], shape: LlamaShape) -> torch.Tensor:
    """The full (unsharded) megatron tensor from its HF tensors (in `hf_names` order)."""
    if megatron_name.endswith(QKV):
        q, k, v = hf
        g, d = shape.num_kv_heads, shape.head_dim
        q = q.reshape(g, shape.heads_per_group * d, shape.hidden_size)
        return torch.cat([q, k.reshape(g, d, -1), v.reshape(g, d, -1)], dim=1).reshape(-1, shape.hidden_size)
    if megatron_name.endswith(FC1):
        return torch.cat(hf, dim=0)
    (only,) = hf
    return only


def split(megatron_name: str, full: torch.Tensor, shape: LlamaShape) -> list[torch.Tensor]:
    """The HF tensors (in `hf_names` order) of a full megatron tensor: `fuse` undone."""
    if megatron_name.endswith(QKV):
        g, d = shape.num_kv_heads, shape.head_dim
        grouped = full.reshape(g, (shape.heads_per_group + 2) * d, shape.hidden_size)
        q, k, v = grouped.split([shape.heads_per_group * d, d, d], dim=1)
        return [t.reshape(-1, shape.hidden_size).contiguous() for t in (q, k, v)]
    if megatron_name.endswith(FC1):
        return [t.contiguous() for t in full.chunk(2, dim=0)]
    return [full]


def shard(megatron_name: str, full: torch.Tensor, partition_dim: int | None, rank: int, size: int) -> torch.Tensor:
    """Tensor-parallel rank `rank`'s shard of `size` of a full megatron tensor (`partition_dim`
    None: the parameter is replicated)."""
    if partition_dim is None or size == 1:
        return full
    if megatron_name.endswith(FC1):  # each rank holds [its gate slice; its up slice]
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]], dim=0)
    return full.chunk(size, dim=partition_dim)[rank]


def unshard(megatron_name: str, shards: list[torch.Tensor], partition_dim: int | None) -> torch.Tensor:
    """The full megatron tensor from every tensor-parallel rank's shard (in rank order): `shard` undone."""
    if partition_dim is None or len(shards) == 1:
        return shards[0]
    if megatron_name.endswith(FC1):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=partition_dim)


def global_name(local_name: str, layer_offset: int) -> str:
    """A pipeline stage's parameter name with its layer number made global."""
    m = _LAYER.fullmatch(local_name)
    return f"decoder.layers.{int(m.group(1)) + layer_offset}.{m.group(2)}" if m else local_name
