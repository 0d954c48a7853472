"""The Hugging Face tokenizer of the served model directory, shared by every engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class HfTokenizer:
    """`tokenize`/`detokenize`/`token_strings` from the model directory's own tokenizer, and the
    prompt check every engine does before generating."""

    def __init__(self, model_dir: Path):
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.vocab_size: int = len(self._tokenizer)
        """Token ids the model embeds: the tokenizer's, unless the engine knows its model's
        (the embedded engine sets its model config's)."""
        self.eos_token_id: int | None = self._tokenizer.eos_token_id
        self.pad_token_id: int | None = self._tokenizer.pad_token_id

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def detokenize(self, token_ids: list[int]) -> str:
        return self._decode(token_ids, skip_special_tokens=True)

    def prompt_text(self, token_ids: list[int]) -> str:
        """The text of a prompt's ids, special tokens kept (vLLM's /detokenize)."""
        return self._decode(token_ids)

    def vocab_strings(self, token_ids: list[int]) -> list[str]:
        """Each id's string in the vocabulary (`Ġthe`, not ` the`), as vLLM's `token_strs`."""
        return [str(t) for t in self._tokenizer.convert_ids_to_tokens(token_ids)]

    def token_strings(self, token_ids: list[int]) -> list[str]:
        return [self._decode([t]) for t in token_ids]

    def _decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        assert isinstance(text, str), "one sequence of ids decodes to one string"
        return text

    def chat_prompt(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        """The token ids of `messages` rendered with the model's chat template. ValueError (a
        422) when the model has none."""
        if not getattr(self._tokenizer, "chat_template", None):
            raise ValueError(
                "the served model's tokenizer has no chat template (tokenizer_config.json chat_template): "
                "use /v1/completions, or serve a model that has one"
            )
        rendered: Any = self._tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=True
        )
        return list(rendered["input_ids"])

    def check_prompt(self, token_ids: list[int]) -> None:
        """ValueError (a 422 for the caller) naming ids the model cannot embed."""
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
