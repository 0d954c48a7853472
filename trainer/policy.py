"""The trainer's policy: the same tiny Llama the replicas serve, trained with a clipped
policy-gradient loss (GRPO-style normalised advantages, PPO-style ratio clip against the
rollout's logprobs, since samples may be a few versions stale)."""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import BaseModel
from safetensors.torch import save_file
from transformers import AutoTokenizer, LlamaForCausalLM


class Sample(BaseModel):
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    weight_version: int
    reward: float


class Policy:
    def __init__(self, model_dir: str, lr: float, clip_ratio: float, seed: int):
        torch.manual_seed(seed)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = LlamaForCausalLM.from_pretrained(model_dir).train()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.clip_ratio = clip_ratio
        self._pad = self.tokenizer.pad_token_id

    def token_id(self, text: str) -> int:
        ids = self.tokenizer(text).input_ids
        if len(ids) != 1:
            raise ValueError(f"reward_text {text!r} is {len(ids)} tokens ({ids}); pick one that is one token")
        return ids[0]

    def train_step(self, batch: list[Sample]) -> float:
        """One optimizer step on `batch`; returns the loss."""
        rewards = torch.tensor([s.reward for s in batch])
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        seqs = [s.prompt_ids + s.completion_ids for s in batch]
        width = max(map(len, seqs))
        ids = torch.full((len(batch), width), self._pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width))
        old = torch.zeros((len(batch), width))
        for i, s in enumerate(batch):
            ids[i, : len(seqs[i])] = torch.tensor(seqs[i])
            start = len(s.prompt_ids)
            mask[i, start : start + len(s.completion_ids)] = 1
            old[i, start : start + len(s.completion_ids)] = torch.tensor(s.logprobs)
        logits = self.model(input_ids=ids).logits[:, :-1].float()
        new = torch.zeros_like(old)
        new[:, 1:] = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        ratio = torch.exp(new - old) * mask
        a = adv[:, None]
        objective = torch.minimum(ratio * a, ratio.clamp(1 - self.clip_ratio, 1 + self.clip_ratio) * a)
        loss = -(objective * mask).sum() / mask.sum().clamp(min=1)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def save(self, path: Path) -> Path:
        """Write the current weights as one safetensors file (atomically)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        state = {k: v.detach().contiguous() for k, v in self.model.state_dict().items()}
        save_file(state, str(tmp))
        tmp.replace(path)
        return path
