"""vLLM's /tokenize and /detokenize on the real app (docs/http_api.md#vllm-routes): the served
model's own tokenizer, giving exactly the ids generation takes for the same prompt or
conversation, with vLLM's shapes and its refusals."""

from __future__ import annotations

import pytest
from integ_util import ok
from transformers import AutoTokenizer

pytestmark = pytest.mark.integration

TEXT = "One two three four"
CHAT = [{"role": "system", "content": "Count."}, {"role": "user", "content": "One two"}]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def test_a_text_tokenizes_as_a_completion_takes_it(http, tokenizer):
    got = ok(http.post("/tokenize", json={"prompt": TEXT, "return_token_strs": True}))
    ids = tokenizer(TEXT).input_ids
    assert got["tokens"] == ids and got["count"] == len(ids), got
    assert got["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    assert isinstance(got["max_model_len"], int) and got["max_model_len"] > len(ids)
    bare = ok(http.post("/tokenize", json={"model": "tiny-llama", "prompt": TEXT, "add_special_tokens": False}))
    assert bare["tokens"] == tokenizer(TEXT, add_special_tokens=False).input_ids
    assert bare["token_strs"] is None
    completion = ok(http.post("/v1/completions", json={"prompt": TEXT, "max_tokens": 1}))
    assert completion["choices"][0]["prompt_token_ids"] == ids


def test_a_conversation_tokenizes_as_chat_renders_it(http):
    got = ok(http.post("/tokenize", json={"messages": CHAT}))
    chat = ok(http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}))
    assert got["tokens"] == chat["prompt_token_ids"] and got["count"] == len(got["tokens"])
    bare = ok(http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}))
    assert len(bare["tokens"]) < len(got["tokens"]) and got["tokens"][: len(bare["tokens"])] == bare["tokens"]


def test_detokenize_keeps_special_tokens_and_round_trips(http, tokenizer):
    ids = tokenizer(TEXT).input_ids
    assert ok(http.post("/detokenize", json={"tokens": ids})) == {"prompt": TEXT}
    marked = [tokenizer.bos_token_id, *ids, tokenizer.eos_token_id]
    got = ok(http.post("/detokenize", json={"tokens": marked}))["prompt"]
    assert got == tokenizer.decode(marked) and got.startswith(tokenizer.bos_token) and tokenizer.eos_token in got


@pytest.mark.parametrize(
    ("route", "body", "code", "words"),
    [
        ("/detokenize", {"tokens": [1, 10**9]}, 422, "tokens: prompt token ids out of range"),
        ("/detokenize", {"tokens": [-1]}, 422, "tokens"),
        ("/detokenize", {"tokens": [1], "model": "other"}, 404, "model 'other' is not served"),
        ("/tokenize", {"prompt": TEXT, "model": "other"}, 404, "model 'other' is not served"),
        ("/tokenize", {"messages": CHAT, "add_special_tokens": True}, 422, "the chat template adds"),
        ("/tokenize", {"prompt": TEXT, "continue_final_message": True}, 422, "continue_final_message"),
        ("/tokenize", {"prompt": "x" * 300_000}, 422, "over request_limits.max_prompt_chars"),
    ],
)
def test_refusals_name_their_cause(http, route, body, code, words):
    r = http.post(route, json=body)
    assert r.status_code == code, r.text
    assert words in r.text, r.text
