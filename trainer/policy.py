"""The trainer's policy: the same tiny Llama the replicas serve, trained with a clipped
policy-gradient loss (GRPO-style normalised advantages, PPO-style ratio clip against the
rollout's logprobs, since samples may be a few versions stale)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel
from safetensors.torch import save_file
from transformers import AutoTokenizer, LlamaForCausalLM

from profiling.manifest import ParallelRank


class Sample(BaseModel):
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    weight_version: int
    reward: float


class Share:
    """One rank's share of a mini-batch as tensors, right-padded: token ids, the completion mask,
    the rollout's logprobs and the advantages (normalised over the whole mini-batch). Both
    trainer backends train on it with the same loss (docs/trainer.md)."""

    def __init__(self, ids: torch.Tensor, mask: torch.Tensor, old: torch.Tensor, adv: torch.Tensor):
        self.ids, self.mask, self.old, self.adv = ids, mask, old, adv

    @classmethod
    def of(cls, batch: list[Sample], part: tuple[int, int], pad: int) -> Share:
        """Rank `part[0]` of `part[1]`'s share: every part[1]-th sample from its rank on."""
        rewards = torch.tensor([s.reward for s in batch])
        adv_all = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        rank, world = part
        batch, adv = batch[rank::world], adv_all[rank::world]
        seqs = [s.prompt_ids + s.completion_ids for s in batch]
        width = max(map(len, seqs))
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width))
        old = torch.zeros((len(batch), width))
        for i, s in enumerate(batch):
            ids[i, : len(seqs[i])] = torch.tensor(seqs[i])
            start = len(s.prompt_ids)
            mask[i, start : start + len(s.completion_ids)] = 1
            old[i, start : start + len(s.completion_ids)] = torch.tensor(s.logprobs)
        return cls(ids, mask, old, adv)

    @property
    def tokens(self) -> torch.Tensor:
        """Completion tokens in the share (at least 1): the loss's denominator."""
        return self.mask.sum().clamp(min=1)

    def rows(self, start: int, stop: int) -> Share:
        """Samples `start` to `stop` of the share (a micro-batch)."""
        return Share(self.ids[start:stop], self.mask[start:stop], self.old[start:stop], self.adv[start:stop])

    def loss(self, new: torch.Tensor, clip_ratio: float, tokens: torch.Tensor) -> torch.Tensor:
        """The clipped policy-gradient loss of these rows given the policy's logprobs `new` of each
        token (0 where masked), summed over their completion tokens and divided by `tokens` (the
        whole share's: micro-batches' losses then add up to the share's)."""
        ratio = torch.exp(new - self.old) * self.mask
        a = self.adv[:, None]
        objective = torch.minimum(ratio * a, ratio.clamp(1 - clip_ratio, 1 + clip_ratio) * a)
        return -(objective * self.mask).sum() / tokens


class TrainingPolicy(ABC):
    """What the training loop needs of a policy, whatever trains it (`trainer.backend`): the FSDP
    `Policy` here, `MegatronPolicy` (trainer/megatron/policy.py). Both share the reward token and
    the write of the published weights; each fills the rest."""

    tokenizer: Any
    """The served model's tokenizer."""
    parallel: ParallelRank | None
    """This rank's place in a Megatron grid (None: the backend has none)."""

    @property
    @abstractmethod
    def context_len(self) -> int:
        """The longest sequence the policy (the served model) takes."""

    @abstractmethod
    def data_part(self, rank: int, world_size: int) -> tuple[int, int]:
        """The share of each mini-batch that trainer rank `rank` of `world_size` trains on, as
        `train_step`'s `part`."""

    @abstractmethod
    def train_step(self, batch: list[Sample], part: tuple[int, int] = (0, 1)) -> float:
        """One optimizer step on rank `part[0]` of `part[1]`'s share of `batch`; returns the loss."""

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model in Hugging Face names on the publishing rank (rank 0), {} on the others:
        a collective every rank joins."""

    def token_id(self, text: str) -> int:
        ids = self.tokenizer(text).input_ids
        if len(ids) != 1:
            raise ValueError(f"reward_text {text!r} is {len(ids)} tokens ({ids}); pick one that is one token")
        return ids[0]

    def save(self, path: Path, state: dict[str, torch.Tensor] | None = None) -> Path:
        """Write the current weights (or `state`, already gathered) as one safetensors file
        (atomically)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        state = state if state is not None else self.full_state_dict()
        save_file(state, str(tmp))
        tmp.replace(path)
        return path


class Policy(TrainingPolicy):
    def __init__(self, model_dir: str, lr: float, clip_ratio: float, seed: int, *, shard: bool = False):
        """`shard`: wrap the model with FSDP2's `fully_shard` (each decoder layer, then the whole),
        over the default process group: every rank of it must construct the policy."""
        torch.manual_seed(seed)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = LlamaForCausalLM.from_pretrained(model_dir).train()
        self.sharded = shard
        self.parallel = None
        if shard:
            from torch.distributed.fsdp import fully_shard

            for layer in self.model.model.layers:
                fully_shard(layer)
            fully_shard(self.model)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.clip_ratio = clip_ratio
        self._pad = self.tokenizer.pad_token_id

    @property
    def context_len(self) -> int:
        """The longest sequence the policy (the served model) takes."""
        return int(self.model.config.max_position_embeddings)

    def data_part(self, rank: int, world_size: int) -> tuple[int, int]:
        """The share of each mini-batch that trainer rank `rank` of `world_size` trains on, as
        `train_step`'s `part`: FSDP shards the data over every rank."""
        return rank, world_size

    def train_step(self, batch: list[Sample], part: tuple[int, int] = (0, 1)) -> float:
        """One optimizer step on `batch`; returns the loss. `part` (rank, world_size): this rank
        trains on every world_size-th sample from its rank on, with advantages normalised over the
        whole mini-batch (FSDP averages the ranks' gradients)."""
        share = Share.of(batch, part, self._pad)
        logits = self.model(input_ids=share.ids).logits[:, :-1].float()
        new = torch.zeros_like(share.old)
        new[:, 1:] = torch.log_softmax(logits, -1).gather(-1, share.ids[:, 1:, None]).squeeze(-1)
        loss = share.loss(new, self.clip_ratio, share.tokens)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on the CPU. Sharded: a collective every rank joins
        (torch.distributed.checkpoint's full-state-dict gather); only rank 0 gets them, the
        others an empty dict."""
        if not self.sharded:
            return {k: v.detach().cpu().contiguous() for k, v in self.model.state_dict().items()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        gathered = get_model_state_dict(self.model, options=options)
        return {k: v.contiguous() for k, v in gathered.items() if isinstance(v, torch.Tensor)}
