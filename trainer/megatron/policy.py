"""The policy on megatron-core (`trainer.backend: megatron`, docs/trainer.md#megatron): the served
Llama as a GPTModel split over tensor- and pipeline-parallel ranks, trained with the same loss as
the FSDP policy through megatron's own schedules, and gathered to one state dict in Hugging Face
Llama names for the replicas.

Every rank of the trainer's process group constructs it (megatron's model-parallel groups are
made from that group). Data parallel is what is left of the world size; its ranks train on their
share of each mini-batch and average their gradients.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer

from profiling.manifest import ParallelRank
from trainer.megatron import cpu_patches, llama_names
from trainer.policy import Sample, Share, TrainingPolicy

log = logging.getLogger(__name__)


class MegatronPolicy(TrainingPolicy):
    """The policy as megatron-core's GPTModel at tensor parallelism `tp` and pipeline parallelism
    `pp` (the data-parallel size is the process group's size over tp * pp), started from the
    Hugging Face checkpoint in `model_dir` (the model the replicas serve)."""

    parallel: ParallelRank
    """This rank's tensor-, pipeline- and data-parallel ranks."""

    def __init__(
        self, model_dir: str, lr: float, clip_ratio: float, seed: int, *, tp: int, pp: int, micro_batch_size: int
    ):
        cpu_patches.apply()  # before megatron.core is imported; nothing where CUDA is present
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        torch.manual_seed(seed)
        hf: Any = AutoConfig.from_pretrained(model_dir)  # a LlamaConfig
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.hf_config = hf
        self.shape = llama_names.LlamaShape(
            num_heads=hf.num_attention_heads,
            num_kv_heads=hf.num_key_value_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
            hidden_size=hf.hidden_size,
        )
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        model_parallel_cuda_manual_seed(seed)
        self.ps = ps
        self.tp, self.pp, self.micro_batch_size = tp, pp, micro_batch_size
        self.dp = ps.get_data_parallel_world_size()
        self.parallel = ParallelRank(
            tp=ps.get_tensor_model_parallel_rank(),
            pp=ps.get_pipeline_model_parallel_rank(),
            dp=ps.get_data_parallel_rank(),
            tp_size=tp,
            pp_size=pp,
            dp_size=self.dp,
        )
        if hf.num_hidden_layers % pp:
            raise ValueError(
                f"the model has {hf.num_hidden_layers} layers, which trainer.megatron.pipeline_parallel_size "
                f"{pp} does not divide into equal stages: pick a size that divides it"
            )
        self.model, self.layer_offset = self._build(hf)
        self._load(load_file(str(Path(model_dir) / "model.safetensors")))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.clip_ratio = clip_ratio
        self._pad = self.tokenizer.pad_token_id

    def _build(self, hf: Any) -> tuple[torch.nn.Module, int]:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        config = TransformerConfig(
            num_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size,
            ffn_hidden_size=hf.intermediate_size,
            num_attention_heads=hf.num_attention_heads,
            num_query_groups=hf.num_key_value_heads,
            kv_channels=self.shape.head_dim,
            normalization="RMSNorm",
            layernorm_epsilon=hf.rms_norm_eps,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            params_dtype=torch.float32,
            pipeline_dtype=torch.float32,
            use_cpu_initialization=not torch.cuda.is_available(),
            # The fused kernels are CUDA's; a GPU job turns them on (docs/trainer.md#megatron).
            gradient_accumulation_fusion=False,
            masked_softmax_fusion=False,
            bias_dropout_fusion=False,
            bias_activation_fusion=False,
            apply_rope_fusion=False,
            persist_layer_norm=False,
            # The loss is already divided by the share's completion tokens (Share.loss).
            calculate_per_token_loss=True,
        )
        rope = getattr(hf, "rope_parameters", None) or {}
        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=hf.vocab_size,
            max_sequence_length=hf.max_position_embeddings,
            pre_process=self.ps.is_pipeline_first_stage(),
            post_process=self.ps.is_pipeline_last_stage(),
            parallel_output=True,
            share_embeddings_and_output_weights=bool(hf.tie_word_embeddings),
            position_embedding_type="rope",
            rotary_base=int(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))),
        )
        return model.train(), get_transformer_layer_offset(config)

    def _params(self) -> list[tuple[str, torch.nn.Parameter, int | None]]:
        """Every parameter of this stage: its global megatron name, itself, its partition dim (None: replicated)."""
        return [
            (
                llama_names.global_name(name, self.layer_offset),
                p,
                getattr(p, "partition_dim", None) if getattr(p, "tensor_model_parallel", False) else None,
            )
            for name, p in self.model.named_parameters()
        ]

    def _load(self, hf_state: dict[str, torch.Tensor]) -> None:
        """This rank's shards of the Hugging Face weights."""
        with torch.no_grad():
            for name, p, dim in self._params():
                full = llama_names.fuse(name, [hf_state[n] for n in llama_names.hf_names(name)], self.shape)
                piece = llama_names.shard(name, full, dim, self.parallel.tp, self.tp)
                if piece.shape != p.shape:
                    raise ValueError(
                        f"the checkpoint's {name} gives a shard of {tuple(piece.shape)}, the model's is "
                        f"{tuple(p.shape)}: the checkpoint and trainer.megatron's layout disagree"
                    )
                p.copy_(piece)

    @property
    def context_len(self) -> int:
        """The longest sequence the policy (the served model) takes."""
        return int(self.hf_config.max_position_embeddings)

    def data_part(self, rank: int, world_size: int) -> tuple[int, int]:
        """The share of each mini-batch this rank trains on: its data-parallel replica's (every
        tensor- and pipeline-parallel rank of a replica trains on the same samples)."""
        return self.parallel.dp, self.dp

    def train_step(self, batch: list[Sample], part: tuple[int, int] = (0, 1)) -> float:
        """One optimizer step on this rank's share of `batch` through megatron's schedule (1F1B
        over micro-batches of `micro_batch_size` with pipeline stages); returns the share's loss
        on every rank of the replica."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        share = Share.of(batch, part, self._pad)
        rows, width = share.ids.shape
        if rows % self.micro_batch_size:
            raise ValueError(
                f"this rank's share of the mini-batch is {rows} samples, not a multiple of "
                f"trainer.megatron.micro_batch_size {self.micro_batch_size}"
            )
        tokens = share.tokens
        micro = [share.rows(i, i + self.micro_batch_size) for i in range(0, rows, self.micro_batch_size)]
        positions = torch.arange(width).expand(self.micro_batch_size, width)

        def loss_of(mb: Share, per_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
            new = torch.zeros_like(mb.old)
            new[:, 1:] = -per_token[:, :-1]  # megatron's per-token loss is minus the label's logprob
            loss = mb.loss(new, self.clip_ratio, tokens)
            return loss, torch.tensor(1, dtype=torch.int), {"loss": loss.detach()}

        def forward_step(data: object, model: torch.nn.Module) -> tuple[torch.Tensor, object]:
            mb: Share = next(data)  # type: ignore[call-overload]
            labels = torch.roll(mb.ids, -1, dims=1)  # position t predicts token t + 1
            output = model(mb.ids, positions, None, labels=labels)
            return output, lambda out: loss_of(mb, out)

        self.optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro),
            model=[self.model],
            num_microbatches=len(micro),
            seq_length=width,
            micro_batch_size=self.micro_batch_size,
            forward_only=False,
        )
        if self.dp > 1:  # the replicas' gradients averaged (megatron's DDP on a GPU job)
            group = self.ps.get_data_parallel_group()
            for p in self.model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=group)
                    p.grad /= self.dp
        self.optimizer.step()
        loss = torch.stack([x["loss"] for x in losses]).sum() if losses else torch.zeros(())
        if self.pp > 1:  # the last stage has it
            dist.broadcast(
                loss,
                src=self.ps.get_pipeline_model_parallel_last_rank(),
                group=self.ps.get_pipeline_model_parallel_group(),
            )
        return float(loss)

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Megatron's own forward of token ids `ids` [batch, seq] through every stage: the full
        vocabulary's logits [batch, seq, vocab] on the last stage's ranks, None on the others
        (every rank of the replica calls it)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        rows, width = ids.shape
        positions = torch.arange(width).expand(rows, width)

        def forward_step(data: object, model: torch.nn.Module) -> tuple[torch.Tensor, object]:
            output = model(next(data), positions, None)  # type: ignore[call-overload]
            return output, lambda out: (out.sum() * 0, {"logits": gather_from_tensor_model_parallel_region(out)})

        self.model.eval()
        try:
            out = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter([ids]),
                model=[self.model],
                num_microbatches=1,
                seq_length=width,
                micro_batch_size=rows,
                forward_only=True,
            )
        finally:
            self.model.train()
        return out[0]["logits"] if self.parallel.last_stage else None

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model in Hugging Face Llama names on global rank 0, the others an empty dict:
        a collective every rank joins. Each stage's tensor-parallel shards are all-gathered in
        their tensor-parallel group, then every other stage of rank 0's replica sends its tensors
        to rank 0."""
        stage: dict[str, torch.Tensor] = {}
        if self.parallel.dp == 0:  # the data-parallel replicas hold the same weights
            group = self.ps.get_tensor_model_parallel_group()
            for name, p, dim in self._params():
                shards = [p.detach()]
                if dim is not None and self.tp > 1:
                    shards = [torch.empty_like(p) for _ in range(self.tp)]
                    dist.all_gather(shards, p.detach().contiguous(), group=group)
                full = llama_names.unshard(name, shards, dim)
                stage.update(zip(llama_names.hf_names(name), llama_names.split(name, full, self.shape), strict=True))
        state = self._merge_stages(stage) if self.pp > 1 else stage
        return state if dist.get_rank() == 0 else {}

    def _merge_stages(self, stage: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rank 0's replica: the other stages' tensor-parallel rank 0 send rank 0 their tensors
        (a list of names and shapes as JSON, then each tensor)."""
        from trainer.megatron.stage_wire import receive_stage, send_stage

        pp_ranks = dist.get_process_group_ranks(self.ps.get_pipeline_model_parallel_group())
        if 0 not in pp_ranks or self.parallel.tp != 0:
            return {}
        if dist.get_rank() != 0:
            send_stage(stage, dst=0)
            return {}
        merged = dict(stage)
        for src in pp_ranks[1:]:
            merged.update(receive_stage(src))
        return merged
