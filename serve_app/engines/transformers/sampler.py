"""The embedded engine's sampler: a `SamplingSpec` applied to one sequence's next-token logits.

`SequenceSampler` keeps what one sequence's sampling depends on (its seed's generator, the
tokens seen for the penalties, how many tokens it has output) and decides when it ends;
`sample_batch` draws the next token of every sequence of a batch from one [batch, vocab] logits
tensor. The semantics are vLLM's: penalties (repetition over prompt and output tokens, then
frequency and presence over output tokens) and the min_tokens mask before temperature; then
min_p, top_k and top_p; reported logprobs come from the raw model distribution (vLLM's default
`raw_logprobs`), not from the processed one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from serve_app.engines.generation import SamplingSpec, TokenLogprobs

Decode = Callable[[list[int]], str]
"""Token ids -> text, with the engine's tokenizer (special tokens kept)."""


@dataclass(frozen=True)
class Finish:
    """Why a sequence ended: 'stop' (with the stop token id or string; None for EOS) or 'length'."""

    reason: str
    stop_reason: str | int | None = None


@dataclass(frozen=True)
class Sampled:
    """One sequence's next token and, when its spec asks for logprobs, their values."""

    token_id: int
    logprobs: TokenLogprobs | None


class SequenceSampler:
    """One sequence's sampling state, from its spec and prompt."""

    def __init__(self, spec: SamplingSpec, prompt_ids: Sequence[int], eos_id: int | None, vocab_size: int):
        bad = [t for t in spec.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids out of the model's vocabulary [0, {vocab_size}): {bad[:5]}")
        self.spec = spec
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.output: list[int] = []
        self.generator = torch.Generator().manual_seed(spec.seed) if spec.seed is not None else None
        self.counts = torch.zeros(vocab_size, dtype=torch.float32)
        """How often each token occurs in the output (frequency and presence penalties); kept
        only for a penalised sequence (every op per token and sequence is one more trace event)."""
        self.seen = torch.zeros(vocab_size, dtype=torch.bool)
        """Tokens of the prompt or output (repetition penalty); kept as `counts` is."""
        if self.penalised:
            self.seen[torch.tensor(list(prompt_ids), dtype=torch.long)] = True
        ends = list(spec.stop_token_ids) + ([] if spec.ignore_eos or eos_id is None else [eos_id])
        # Tokens that would end the sequence, masked until min_tokens tokens are out.
        self.end_ids = torch.tensor(sorted(set(ends)), dtype=torch.long)
        self._stop_ids = set(spec.stop_token_ids)
        self._longest_stop = max((len(s) for s in spec.stop), default=0)

    @property
    def penalised(self) -> bool:
        s = self.spec
        return s.repetition_penalty != 1.0 or s.presence_penalty != 0.0 or s.frequency_penalty != 0.0

    def append(self, token_id: int, decode: Decode) -> Finish | None:
        """Record the sampled `token_id`; how the sequence ends with it, if it does."""
        self.output.append(token_id)
        if self.penalised:
            self.counts[token_id] += 1
            self.seen[token_id] = True
        s = self.spec
        if len(self.output) >= s.min_tokens:
            if token_id == self.eos_id and not s.ignore_eos:
                return Finish("stop")
            if token_id in self._stop_ids:
                return Finish("stop", token_id)
            if matched := self._stop_string(decode):
                return Finish("stop", matched)
        if len(self.output) >= s.max_tokens:
            return Finish("length")
        return None

    def _stop_string(self, decode: Decode) -> str | None:
        """The stop string the last token completed in the output text, if any. Only the tail
        is decoded: every token decodes to at least one character, so the last `longest + 1`
        tokens cover any stop string ending in the last token's text."""
        if not self._longest_stop:
            return None
        tail = self.output[-(self._longest_stop + 1) :]
        before = len(decode(tail[:-1]))
        text = decode(tail)
        found: tuple[int, str] | None = None
        for stop in self.spec.stop:
            # Matches ending in the new token's text: one ending earlier was already checked
            # (or came before min_tokens, where stop strings do not count).
            at = text.find(stop, max(0, before - len(stop) + 1))
            if at >= 0 and (found is None or at < found[0]):
                found = (at, stop)
        return None if found is None else found[1]


def top_logprobs(logprobs: torch.Tensor, token_ids: Sequence[int], ks: Sequence[int]) -> list[TokenLogprobs]:
    """Row i's `token_ids[i]` logprob and its `ks[i]` most likely tokens', from `logprobs`
    [rows, vocab] of log-probabilities, for all rows in a fixed number of tensor ops."""
    if not token_ids:
        return []
    chosen = torch.tensor(list(token_ids), dtype=torch.long).unsqueeze(1)
    own_t = logprobs.gather(1, chosen)
    own = own_t.squeeze(1).tolist()
    ranks = ((logprobs > own_t).sum(dim=1) + 1).tolist()  # vLLM's rank: 1 + the tokens more likely
    ks = [min(k, logprobs.shape[-1]) for k in ks]
    values, ids = logprobs.topk(max(ks)) if max(ks) > 0 else (logprobs[:, :0], logprobs[:, :0])
    values_l, ids_l = values.tolist(), ids.tolist()
    return [
        TokenLogprobs(
            logprob=own[j],
            top={int(t): float(v) for t, v in zip(ids_l[j][:k], values_l[j][:k], strict=True)},
            rank=int(ranks[j]),
        )
        for j, k in enumerate(ks)
    ]


def prompt_logprobs(logits: torch.Tensor, prompt_ids: Sequence[int], k: int) -> list[TokenLogprobs | None]:
    """Each prompt token's logprob given the tokens before it, with the `k` most likely
    alternatives; `logits`: [len(prompt_ids), vocab], row j predicting token j + 1. The first
    token has none."""
    logprobs = torch.log_softmax(logits[: len(prompt_ids) - 1].float(), dim=-1)
    out: list[TokenLogprobs | None] = [None]
    out.extend(top_logprobs(logprobs, prompt_ids[1:], [k] * (len(prompt_ids) - 1)))
    return out


def sample_batch(logits: torch.Tensor, seqs: Sequence[SequenceSampler]) -> list[Sampled | ValueError]:
    """The next token of each sequence (row i of `logits` [batch, vocab] is `seqs[i]`'s), or the
    ValueError that sampling that one sequence ran into (the others are unaffected). The batch
    takes a fixed number of tensor ops whatever its size: only a seeded sequence draws alone (its
    own generator), so a profiled forward step records a few events, not a few per sequence."""
    logits = logits.float()
    processed = _processed(logits, seqs)
    greedy = processed.argmax(dim=-1).tolist()
    probs = torch.softmax(processed, dim=-1)
    # A row with no finite distribution (NaN, every token masked) fails alone, never the draw of all.
    broken = torch.isnan(probs).any(dim=-1).tolist()
    drawn = _drawn_together(
        probs, [i for i, s in enumerate(seqs) if _draws(s) and s.generator is None and not broken[i]]
    )
    tokens: list[int | ValueError] = []
    for i, s in enumerate(seqs):
        if not _draws(s):
            tokens.append(int(greedy[i]))
        elif broken[i]:
            tokens.append(ValueError("sampling failed: no finite probabilities left (NaN, or every token masked)"))
        elif i in drawn:
            tokens.append(drawn[i])
        else:
            tokens.append(int(torch.multinomial(probs[i], 1, generator=s.generator)))
    reported = _logprobs(logits, seqs, tokens)
    return [t if isinstance(t, ValueError) else Sampled(t, reported.get(i)) for i, t in enumerate(tokens)]


def _draws(s: SequenceSampler) -> bool:
    """Whether the sequence samples (else it is greedy: the argmax)."""
    return s.spec.temperature != 0


def _drawn_together(probs: torch.Tensor, rows: list[int]) -> dict[int, int]:
    """One multinomial draw for all of `rows` (sequences on the global generator)."""
    if not rows:
        return {}
    picked = probs if len(rows) == probs.shape[0] else probs[torch.tensor(rows, dtype=torch.long)]
    return dict(zip(rows, torch.multinomial(picked, 1).squeeze(1).tolist(), strict=True))


def _logprobs(
    logits: torch.Tensor, seqs: Sequence[SequenceSampler], tokens: list[int | ValueError]
) -> dict[int, TokenLogprobs]:
    """For each row whose spec asks for logprobs and that sampled, its token's logprob and the
    `k` most likely tokens', from the raw model distribution, for all such rows at once."""
    rows = [i for i, s in enumerate(seqs) if s.spec.logprobs is not None and not isinstance(tokens[i], ValueError)]
    if not rows:
        return {}
    raw = torch.log_softmax(logits[torch.tensor(rows, dtype=torch.long)], dim=-1)
    chosen = [t for i in rows if isinstance(t := tokens[i], int)]
    return dict(zip(rows, top_logprobs(raw, chosen, [seqs[i].spec.logprobs or 0 for i in rows]), strict=True))


def _processed(logits: torch.Tensor, seqs: Sequence[SequenceSampler]) -> torch.Tensor:
    """The logits to sample from: penalties, min_tokens mask, temperature, min_p, top_k, top_p
    (greedy rows get penalties and the mask only: their argmax is taken)."""
    logits = logits.clone()
    if any(s.penalised for s in seqs):
        logits = _penalised(logits, seqs)
    for i, s in enumerate(seqs):
        if len(s.output) < s.spec.min_tokens and s.end_ids.numel():
            logits[i, s.end_ids] = float("-inf")
    temps = torch.tensor([s.spec.temperature or 1.0 for s in seqs], dtype=logits.dtype)
    logits = logits / temps.unsqueeze(1)
    min_p = torch.tensor([s.spec.min_p for s in seqs], dtype=logits.dtype)
    if bool((min_p > 0).any()):
        probs = torch.softmax(logits, dim=-1)
        floor = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    top_k = [s.spec.top_k for s in seqs]
    top_p = torch.tensor([s.spec.top_p for s in seqs], dtype=logits.dtype)
    if any(top_k) or bool((top_p < 1).any()):
        logits = _top_k_top_p(logits, top_k, top_p)
    return logits


def _penalised(logits: torch.Tensor, seqs: Sequence[SequenceSampler]) -> torch.Tensor:
    """vLLM's penalties: repetition (divide positive logits, multiply negative ones) over prompt
    and output tokens, then frequency (per occurrence) and presence (once) over output tokens."""
    seen = torch.stack([s.seen for s in seqs])
    counts = torch.stack([s.counts for s in seqs])
    rep = torch.tensor([s.spec.repetition_penalty for s in seqs], dtype=logits.dtype).unsqueeze(1)
    freq = torch.tensor([s.spec.frequency_penalty for s in seqs], dtype=logits.dtype).unsqueeze(1)
    pres = torch.tensor([s.spec.presence_penalty for s in seqs], dtype=logits.dtype).unsqueeze(1)
    repeated = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, repeated, logits)
    return logits - freq * counts - pres * (counts > 0).to(logits.dtype)


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's `top_k` most likely tokens (0: all), then the smallest set of those whose
    probability reaches `top_p` (the most likely token always stays)."""
    vocab = logits.shape[-1]
    ordered, order = logits.sort(dim=-1, descending=True)
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k])
    rank = torch.arange(vocab).unsqueeze(0)
    ordered = ordered.masked_fill(rank >= ks.unsqueeze(1), float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
    ordered = ordered.masked_fill((before >= top_p.unsqueeze(1)) & (rank > 0), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)
