"""A tiny Llama and its BPE tokenizer, built locally and deterministically (no network, ever).

The model directory is a regular Hugging Face checkpoint (config.json, model.safetensors,
tokenizer.json), so every engine (embedded transformers, vLLM) loads the same files.
Building is keyed by a hash of the spec and cached; concurrent builders are serialised with a
file lock so that replicas starting together do not race.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

# A small built-in corpus: enough text for a 512-token BPE vocabulary.
_CORPUS = """
The rollout server answers prompts while the trainer learns from the answers.
A weight update publishes a new parameter version to every replica.
Profiling a step records the forward passes that ran with the previous weights.
One two three four five six seven eight nine ten eleven twelve.
Red green blue yellow orange purple black white grey brown pink.
The quick brown fox jumps over the lazy dog near the river bank.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25.
Questions and answers, prompts and completions, rewards and returns, losses and gradients.
abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'"()[]{}<>+-*/=_@#$%^&|~
Every replica keeps its own trace directory; every step keeps its own manifest.
"""


CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
"""The tiny model's chat template (Jinja, as in tokenizer_config.json): each message is a
`<s>role: content</s>` line, and the assistant's turn opens with `<s>assistant:`."""

_BUILD = 2
"""Bumped when the files built for a spec change (2: the chat template), so caches rebuild."""


class TinyModelSpec(BaseModel):
    """Shape of the tiny Llama (`args.tiny_model`), built when `model_path` is null."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    vocab_size: int = Field(512, ge=300)
    """BPE vocabulary size, trained on the built-in corpus."""
    hidden_size: int = Field(128, ge=32)
    """Width of the residual stream."""
    intermediate_size: int = Field(256, ge=32)
    """Width of each MLP."""
    num_hidden_layers: int = Field(2, ge=1)
    """Decoder layers."""
    num_attention_heads: int = Field(4, ge=1)
    """Query heads; head_dim = hidden_size / num_attention_heads (vLLM's CPU attention needs >= 32)."""
    num_key_value_heads: int = Field(2, ge=1)
    """Key/value heads (grouped-query attention); must divide num_attention_heads."""
    max_position_embeddings: int = Field(512, ge=64)
    """Longest sequence the model takes."""
    seed: int = 0
    """Seed of the random initial weights (the same spec always builds the same model)."""

    @model_validator(mode="after")
    def _llama_shape(self) -> TinyModelSpec:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be a multiple of num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads {self.num_key_value_heads} must divide "
                f"num_attention_heads {self.num_attention_heads}"
            )
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def digest(self) -> str:
        return hashlib.sha256(f"{_BUILD}:{self.model_dump_json()}".encode()).hexdigest()[:12]


def default_cache_dir() -> Path:
    """Where built models live: $ROLLOUT_PROFILER_CACHE, else ~/.cache/rollout-profiler."""
    root = os.environ.get("ROLLOUT_PROFILER_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "rollout-profiler"


def ensure_tiny_model(spec: TinyModelSpec | None = None, cache_dir: Path | None = None) -> Path:
    """Return the directory of the tiny model for `spec`, building it on first use."""
    spec = spec or TinyModelSpec()
    cache_dir = Path(cache_dir or default_cache_dir())
    target = cache_dir / f"tiny-llama-{spec.digest()}"
    if (target / "DONE").exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "DONE").exists():
            _build(spec, target)
    return target


def _build(spec: TinyModelSpec, target: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=spec.vocab_size,
            special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "bos_token": "<s>",
                    "eos_token": "</s>",
                    "unk_token": "<unk>",
                    "pad_token": "<pad>",
                    "model_max_length": spec.max_position_embeddings,
                    "chat_template": CHAT_TEMPLATE,
                }
            )
        )
        config = LlamaConfig(
            vocab_size=spec.vocab_size,
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            num_hidden_layers=spec.num_hidden_layers,
            num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.num_key_value_heads,
            max_position_embeddings=spec.max_position_embeddings,
            bos_token_id=tok.token_to_id("<s>"),
            eos_token_id=tok.token_to_id("</s>"),
            pad_token_id=tok.token_to_id("<pad>"),
            tie_word_embeddings=False,
            dtype="float32",
        )
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
        model.save_pretrained(tmp, safe_serialization=True)
        (tmp / "DONE").write_text(spec.model_dump_json())
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
