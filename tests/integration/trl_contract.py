"""What TRL's own client (`trl.generation.vllm_client.VLLMClient`, trl 1.16.0: what GRPOTrainer's
`vllm_mode="server"` drives a vLLM server with) does against the app, with no change on TRL's
side (docs/frameworks/trl.md): the same tests on every engine. A test module imports them and
defines the `trl` fixture (a VLLMClient on its app)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

PROMPTS = ["The quick brown fox", "One two three four"]


def test_trl_generate_text_and_token_id_prompts_with_n_and_the_sampled_tokens_logprob(trl):
    out = trl.generate(PROMPTS, n=2, temperature=0.0, max_tokens=4, logprobs=0)
    assert len(out["prompt_ids"]) == len(PROMPTS) and len(out["completion_ids"]) == 2 * len(PROMPTS)
    assert all(len(c) == 4 for c in out["completion_ids"])
    # logprobs 0: each position has the sampled token alone, as vLLM answers.
    for ids, lps, lp_ids in zip(out["completion_ids"], out["logprobs"], out["logprob_token_ids"], strict=True):
        assert lp_ids == [[t] for t in ids]
        assert all(len(p) == 1 and p[0] <= 0 for p in lps)
    again = trl.generate(out["prompt_ids"], n=2, temperature=0.0, max_tokens=4, logprobs=0)
    assert again["prompt_ids"] == out["prompt_ids"], "token-id prompts come back as sent"
    assert again["completion_ids"] == out["completion_ids"], "greedy: the same tokens from the same prompt"


def test_trl_generate_takes_every_sampling_field_and_ranks_the_alternatives(trl):
    out = trl.generate(
        PROMPTS[:1],
        n=3,
        temperature=0.9,
        top_p=0.95,
        top_k=20,
        min_p=0.01,
        repetition_penalty=1.1,
        max_tokens=6,
        logprobs=2,
        generation_kwargs={"seed": 7, "presence_penalty": 0.1},
    )
    assert len(out["completion_ids"]) == 3
    for ids, lps, lp_ids in zip(out["completion_ids"], out["logprobs"], out["logprob_token_ids"], strict=True):
        for token, values, alternatives in zip(ids, lps, lp_ids, strict=True):
            assert token in alternatives, "the sampled token is always there"
            assert len(alternatives) in (2, 3) and values == sorted(values, reverse=True)
    seeded = [
        trl.generate(PROMPTS[:1], n=3, temperature=0.9, max_tokens=6, generation_kwargs={"seed": 7}) for _ in range(2)
    ]
    # The same tokens; their logprobs to float noise (the two calls may reach different replicas).
    assert seeded[0]["completion_ids"] == seeded[1]["completion_ids"]
    flat = [[v for pos in seq for v in pos] for seq in seeded[0]["logprobs"]]
    again = [[v for pos in seq for v in pos] for seq in seeded[1]["logprobs"]]
    assert all(a == pytest.approx(b, abs=1e-4) for a, b in zip(flat, again, strict=True))


def test_trl_chat_answers_with_the_rendered_prompt_and_logprobs(trl, model_dir):
    messages = [[{"role": "user", "content": "Red green blue"}], [{"role": "user", "content": "One two"}]]
    out = trl.chat(messages, temperature=0.0, max_tokens=5, logprobs=1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    for conversation, prompt in zip(messages, out["prompt_ids"], strict=True):
        rendered = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=True)
        assert prompt == list(rendered["input_ids"])
    for ids, lp_ids in zip(out["completion_ids"], out["logprob_token_ids"], strict=True):
        assert len(ids) == 5 and all(t in alternatives for t, alternatives in zip(ids, lp_ids, strict=True))


def test_trl_sequence_logprobs_score_what_generate_sampled(trl):
    """get_sequence_logprobs (knowledge distillation's teacher scores) through `prompt_logprobs`:
    the tokens generate chose greedily score as generate reported them, and rank first."""
    out = trl.generate(PROMPTS[:1], temperature=0.0, max_tokens=5, logprobs=0)
    prompt, completion = out["prompt_ids"][0], out["completion_ids"][0]
    scored = trl.get_sequence_logprobs([prompt + completion], [len(prompt)], top_logprobs=3)
    actual = [p[0] for p in scored["actual_logprobs"][0]]
    assert actual == pytest.approx([p[0] for p in out["logprobs"][0]], abs=1e-4)
    assert [ids[0] for ids in scored["logprob_token_ids"][0]] == completion, "greedy tokens rank first"
    assert all(len(ids) == 3 for ids in scored["logprob_token_ids"][0])


def test_trl_nccl_weight_sync_is_refused_with_trls_own_message(trl):
    with pytest.raises(RuntimeError, match="has no weight-transfer engine"):
        trl.init_communicator(device="cpu")


def test_trl_reset_prefix_cache(trl):
    trl.reset_prefix_cache()  # raises unless the app answers 200 with vLLM's {"success": ...}
    resp = trl.session.post(f"{trl.base_url}/reset_prefix_cache")
    assert resp.status_code == 200 and resp.json()["success"] is True, resp.text
