"""The embedded engine's sampler (serve_app/engines/transformers/sampler.py): each SamplingSpec field's effect
on the next token, and how a sequence ends."""

from __future__ import annotations

import math

import pytest
import torch

from serve_app.engines.generation import SamplingSpec
from serve_app.engines.transformers.sampler import Finish, Sampled, SequenceSampler, prompt_logprobs, sample_batch

VOCAB = 8
EOS = 7
# A toy tokenizer: token i is the letter "abcdefg"[i], EOS decodes to nothing.
LETTERS = "abcdefg"


def decode(ids: list[int]) -> str:
    return "".join(LETTERS[i] for i in ids if i < len(LETTERS))


def seq(prompt: list[int] | None = None, /, **spec: object) -> SequenceSampler:
    fields: dict[str, object] = {"max_tokens": 100, **spec}
    return SequenceSampler(SamplingSpec.model_validate(fields), prompt or [0], EOS, VOCAB)


def token(logits: list[float], s: SequenceSampler) -> int:
    (out,) = sample_batch(torch.tensor([logits]), [s])
    assert isinstance(out, Sampled)
    return out.token_id


def draws(logits: list[float], n: int = 200, **spec: object) -> set[int]:
    """The tokens sampled in `n` seeded draws."""
    return {token(logits, seq(seed=i, **spec)) for i in range(n)}


FLAT = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, -5.0]


def test_greedy_takes_the_argmax():
    assert draws(FLAT, n=5, temperature=0) == {0}


def test_sampling_at_temperature_one_reaches_many_tokens():
    assert len(draws(FLAT)) >= 5


def test_top_k_one_and_a_tiny_top_p_equal_greedy():
    assert draws(FLAT, top_k=1) == {0}
    assert draws(FLAT, top_p=1e-6) == {0}


def test_top_k_keeps_the_k_most_likely():
    assert draws(FLAT, top_k=3) == {0, 1, 2}


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = [math.log(p) for p in (0.5, 0.3, 0.15, 0.05)] + [-30.0] * 4
    assert draws(logits, top_p=0.7) == {0, 1}
    assert draws(logits, top_p=0.85) == {0, 1, 2}


def test_min_p_drops_tokens_below_its_share_of_the_top_probability():
    logits = [math.log(p) for p in (0.4, 0.3, 0.19, 0.11)] + [-30.0] * 4
    assert draws(logits, min_p=0.5) == {0, 1}  # 0.19 < 0.5 * 0.4


def test_low_temperature_sharpens_and_reported_logprobs_stay_raw():
    assert draws(FLAT, temperature=0.001) == {0}
    (hot,) = sample_batch(torch.tensor([FLAT]), [seq(temperature=0.01, seed=0, logprobs=2)])
    (plain,) = sample_batch(torch.tensor([FLAT]), [seq(temperature=1.0, seed=0, logprobs=2, top_k=1)])
    assert isinstance(hot, Sampled) and isinstance(plain, Sampled)
    assert hot.logprobs is not None and hot.logprobs == plain.logprobs
    raw = torch.log_softmax(torch.tensor(FLAT), dim=-1)
    assert hot.logprobs.logprob == pytest.approx(float(raw[0]))
    assert list(hot.logprobs.top) == [0, 1]
    assert hot.logprobs.top[1] == pytest.approx(float(raw[1]))


def test_logprobs_zero_gives_only_the_sampled_token_and_none_gives_nothing():
    (zero, none) = sample_batch(torch.tensor([FLAT, FLAT]), [seq(logprobs=0, seed=1), seq(seed=1)])
    assert isinstance(zero, Sampled) and zero.logprobs is not None and zero.logprobs.top == {}
    assert isinstance(none, Sampled) and none.logprobs is None


def test_seeds_reproduce_and_differ():
    def run(seed: int) -> list[int]:
        s = seq(seed=seed)
        out = []
        for _ in range(20):
            t = token(FLAT, s)
            s.append(t, decode)
            out.append(t)
        return out

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_a_batch_samples_each_row_with_its_own_spec():
    rows = torch.tensor([FLAT, list(reversed(FLAT))])
    a, b = sample_batch(rows, [seq(temperature=0), seq(top_k=1, seed=0)])
    assert isinstance(a, Sampled) and isinstance(b, Sampled)
    assert (a.token_id, b.token_id) == (0, 7)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    # Token 0 is in the prompt: 2.0 / 2 = 1.0 < 1.5, so token 1 wins.
    assert token([2.0, 1.5] + [-9.0] * 6, seq([0], temperature=0, repetition_penalty=2.0)) == 1
    # Negative: -1.0 * 2 = -2.0 < -1.5.
    assert token([-1.0, -1.5] + [-9.0] * 6, seq([0], temperature=0, repetition_penalty=2.0)) == 1
    # Output tokens count too.
    s = seq([3], temperature=0, repetition_penalty=2.0)
    s.append(0, decode)
    assert token([2.0, 1.5] + [-9.0] * 6, s) == 1
    assert token([2.0, 1.5] + [-9.0] * 6, seq([3], temperature=0, repetition_penalty=2.0)) == 0


def _after(output: list[int], **spec: object) -> SequenceSampler:
    s = seq([0], temperature=0, **spec)  # token 0 is also in the prompt: it must not count
    for t in output:
        s.append(t, decode)
    return s


def test_frequency_penalty_counts_each_occurrence_in_the_output():
    logits = [3.0, 2.5] + [-9.0] * 6
    assert token(logits, _after([0, 0], frequency_penalty=0.2)) == 0  # 3 - 0.4 > 2.5
    assert token(logits, _after([0, 0], frequency_penalty=0.3)) == 1  # 3 - 0.6 < 2.5
    assert token(logits, _after([], frequency_penalty=5.0)) == 0  # the prompt does not count


def test_presence_penalty_counts_once():
    logits = [3.0, 2.5] + [-9.0] * 6
    assert token(logits, _after([0, 0], presence_penalty=0.4)) == 0  # once: 2.6 > 2.5
    assert token(logits, _after([0, 0], presence_penalty=0.6)) == 1
    assert token(logits, _after([], presence_penalty=5.0)) == 0


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = [0.0] * 5 + [9.0, 0.5, 10.0]  # EOS (7) most likely, then stop token 5
    s = seq(temperature=0, min_tokens=3, stop_token_ids=[5])
    picks = []
    for _ in range(3):
        t = token(logits, s)
        picks.append(t)
        assert s.append(t, decode) is None
    assert picks == [6, 6, 6]
    assert token(logits, s) == EOS
    assert s.append(EOS, decode) == Finish("stop")


def test_how_a_sequence_ends():
    assert seq().append(EOS, decode) == Finish("stop", None)
    assert seq(ignore_eos=True).append(EOS, decode) is None
    assert seq(stop_token_ids=[4]).append(4, decode) == Finish("stop", 4)
    s = seq(max_tokens=2)
    assert s.append(1, decode) is None
    assert s.append(EOS, decode) == Finish("stop")  # a stop beats the length
    s = seq(max_tokens=2)
    s.append(1, decode)
    assert s.append(1, decode) == Finish("length")


def test_a_stop_string_across_tokens_ends_with_that_string():
    s = seq(stop=["cd", "zz"])
    assert [s.append(t, decode) for t in (0, 1, 2)] == [None, None, None]
    assert s.append(3, decode) == Finish("stop", "cd")


def test_the_earliest_stop_string_wins():
    s = seq(stop=["bcd", "cd"])
    for t in (0, 1, 2):
        s.append(t, decode)
    assert s.append(3, decode) == Finish("stop", "bcd")


def test_stop_strings_do_not_count_before_min_tokens():
    s = seq(stop=["ab"], min_tokens=3)
    assert [s.append(t, decode) for t in (0, 1, 2)] == [None, None, None]  # "ab" came at 2
    assert s.append(0, decode) is None  # ...and is not matched later
    assert s.append(1, decode) == Finish("stop", "ab")


def test_stop_token_ids_outside_the_vocabulary_are_refused():
    with pytest.raises(ValueError, match="stop_token_ids"):
        seq(stop_token_ids=[VOCAB])


def test_prompt_logprobs_score_each_token_after_the_first():
    logits = torch.randn(3, VOCAB)
    out = prompt_logprobs(logits, [4, 2, 6], k=2)
    assert out[0] is None and len(out) == 3
    expected = torch.log_softmax(logits, dim=-1)
    assert out[1] is not None and out[2] is not None
    assert out[1].logprob == pytest.approx(float(expected[0, 2]))
    assert out[2].logprob == pytest.approx(float(expected[1, 6]))
    assert set(out[2].top) == set(expected[1].topk(2).indices.tolist())


def _ops_recorded(batch: int) -> int:
    """Operator events a profiler records while `batch` unseeded sequences asking for logprobs
    draw one token each."""
    seqs = [seq(temperature=1.0, logprobs=1) for _ in range(batch)]
    logits = torch.randn(batch, VOCAB)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        sample_batch(logits, seqs)
    return len(prof.events())


def test_a_batch_draws_in_the_same_ops_whatever_its_size():
    """A profiled forward step must not record a few events per sequence: the trace, its
    finalize, export and merge grow with the events (docs/benchmarks.md)."""
    assert _ops_recorded(64) == _ops_recorded(4)


def test_unseeded_rows_drawn_together_follow_each_rows_spec():
    rows = torch.tensor([FLAT] * 8 + [list(reversed(FLAT))] * 8)
    out = sample_batch(rows, [seq(top_k=1) for _ in range(16)])
    assert [o.token_id for o in out if isinstance(o, Sampled)] == [0] * 8 + [7] * 8


def test_a_row_with_nothing_left_to_draw_fails_alone_among_rows_drawn_together():
    masked = [float("-inf")] * VOCAB
    out = sample_batch(torch.tensor([FLAT, masked, FLAT]), [seq(top_k=1), seq(), seq(top_k=1, seed=2)])
    assert isinstance(out[1], ValueError) and "sampling failed" in str(out[1])
    assert [o.token_id for o in (out[0], out[2]) if isinstance(o, Sampled)] == [0, 0]


def test_logprobs_of_a_batch_are_each_rows_own():
    logits = torch.randn(3, VOCAB)
    out = sample_batch(logits, [seq(temperature=0, logprobs=3), seq(temperature=0), seq(temperature=0, logprobs=1)])
    raw = torch.log_softmax(logits, dim=-1)
    for i, k in ((0, 3), (2, 1)):
        got = out[i]
        assert isinstance(got, Sampled) and got.logprobs is not None
        assert got.logprobs.logprob == pytest.approx(float(raw[i, got.token_id]))
        values, ids = raw[i].topk(k)
        assert got.logprobs.top == pytest.approx(dict(zip(ids.tolist(), values.tolist(), strict=True)))
    assert isinstance(out[1], Sampled) and out[1].logprobs is None
