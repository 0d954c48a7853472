"""The rollout API's contract with RL frameworks, checked with the official `openai` client
(docs/http_api.md#openai-routes): the same tests for every engine. A test module imports them
and defines the fixtures they take: `oai` (an `openai.OpenAI` on an app whose weights are at
version 0 while these run) and `tok` (the served model's tokenizer)."""

from __future__ import annotations

import itertools

import pytest


def spans_cover(choice: dict, count: int | None = None) -> list[dict]:
    """The choice's spans, checked to tile [0, len(token_ids)) in order. `count`: for a streamed
    choice's last piece, the number of tokens the whole choice had (its own `weight_version` is
    then that piece's, not the oldest)."""
    spans = choice["weight_versions"]
    n = len(choice["token_ids"]) if count is None else count
    assert spans, choice
    assert spans[0]["start"] == 0 and spans[-1]["end"] == n, spans
    for a, b in itertools.pairwise(spans):
        assert a["end"] == b["start"] and a["version"] < b["version"], spans
    if count is None:
        assert choice["weight_version"] == spans[0]["version"], "a choice's weight_version is its oldest"
    return spans


def dump(obj) -> dict:
    return obj.model_dump()


def test_models_list(oai):
    assert [m.id for m in oai.models.list().data] == ["tiny-llama"]


def test_every_prompt_form(oai, tok):
    text = "The rollout server answers"
    ids = tok(text).input_ids
    by_text = oai.completions.create(model="tiny-llama", prompt=text, max_tokens=4, temperature=0)
    by_ids = oai.completions.create(model="tiny-llama", prompt=ids, max_tokens=4, temperature=0)
    batch = oai.completions.create(model="tiny-llama", prompt=[text, "Red green blue"], max_tokens=4, temperature=0)
    id_batch = oai.completions.create(
        model="tiny-llama", prompt=[ids, tok("Red green blue").input_ids], max_tokens=4, temperature=0
    )
    assert by_text.choices[0].text == by_ids.choices[0].text
    for resp in (batch, id_batch):
        assert [c.index for c in resp.choices] == [0, 1]
        assert resp.choices[0].text == by_text.choices[0].text
        assert resp.usage.prompt_tokens == sum(len(dump(c)["prompt_token_ids"]) for c in resp.choices)
        assert resp.usage.completion_tokens == sum(len(dump(c)["token_ids"]) for c in resp.choices)
    assert dump(by_ids.choices[0])["prompt_token_ids"] == ids


def test_n_group_each_choice_its_own_tokens(oai):
    resp = oai.completions.create(
        model="tiny-llama", prompt=["One two three", "Red green"], n=8, max_tokens=12, seed=7, logprobs=1
    )
    assert [c.index for c in resp.choices] == list(range(16))
    answers = set()
    for c in map(dump, resp.choices):
        spans_cover(c)
        assert len(c["logprobs"]["token_logprobs"]) == len(c["token_ids"])
        answers.add(tuple(c["token_ids"]))
    assert len(answers) > 8, "choices of a group are sampled independently"
    again = oai.completions.create(
        model="tiny-llama", prompt=["One two three", "Red green"], n=8, max_tokens=12, seed=7, logprobs=1
    )
    assert [c.text for c in again.choices] == [c.text for c in resp.choices], "a seeded group repeats"
    # One prompt counted once, however many choices.
    assert resp.usage.prompt_tokens == len(dump(resp.choices[0])["prompt_token_ids"]) + len(
        dump(resp.choices[8])["prompt_token_ids"]
    )


def test_every_sampling_field_is_taken(oai):
    resp = oai.completions.create(
        model="tiny-llama",
        prompt="Questions and answers",
        n=2,
        max_tokens=10,
        temperature=0.8,
        top_p=0.9,
        seed=3,
        stop=["zzzz"],
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logprobs=2,
        echo=False,
        user="rl-worker-1",
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "stop_token_ids": [5],
            "ignore_eos": True,
            "min_tokens": 10,
            "repetition_penalty": 1.2,
            "include_stop_str_in_output": False,
        },
    )
    for c in map(dump, resp.choices):
        assert len(c["token_ids"]) == 10, "min_tokens = max_tokens: nothing ends the choice earlier"
        # Two alternatives each, and the sampled token when it is not one of them (vLLM's shape;
        # keyed by text: ids of partial UTF-8 bytes share one).
        lp = c["logprobs"]
        for token, top in zip(lp["tokens"], lp["top_logprobs"], strict=True):
            assert len(top) in (2, 3) or "\ufffd" in top, lp
            assert token in top, "the sampled token is always among top_logprobs"


def test_sampling_cuts_that_leave_one_token_are_greedy(oai):
    greedy = oai.completions.create(model="tiny-llama", prompt="The quick brown", max_tokens=12, temperature=0)
    for cut in ({"extra_body": {"top_k": 1}}, {"top_p": 1e-6}, {"extra_body": {"min_p": 1.0}}):
        resp = oai.completions.create(model="tiny-llama", prompt="The quick brown", max_tokens=12, seed=11, **cut)
        assert resp.choices[0].text == greedy.choices[0].text, cut


def test_stop_strings_cut_the_text_and_keep_the_tokens(oai, tok):
    base = oai.completions.create(
        model="tiny-llama", prompt="One two", max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    full = base.choices[0].text
    assert len(full) > 6
    stop = full[3:6]
    cut = dump(
        oai.completions.create(model="tiny-llama", prompt="One two", max_tokens=24, temperature=0, stop=[stop]).choices[
            0
        ]
    )
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    assert cut["text"] == full[: full.index(stop)]
    assert stop in tok.decode(cut["token_ids"]), "the tokens that made the stop string stay"
    assert stop not in tok.decode(cut["token_ids"][:-1]), "the choice stops at the token completing it"
    kept = dump(
        oai.completions.create(
            model="tiny-llama",
            prompt="One two",
            max_tokens=24,
            temperature=0,
            stop=[stop],
            extra_body={"include_stop_str_in_output": True},
        ).choices[0]
    )
    assert kept["text"] == full[: full.index(stop) + len(stop)]


def test_stop_token_ids_ignore_eos_and_min_tokens(oai):
    base = dump(
        oai.completions.create(
            model="tiny-llama", prompt="Red green", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        ).choices[0]
    )
    assert len(base["token_ids"]) == 12 and base["finish_reason"] == "length"
    stop_id = base["token_ids"][4]
    first = base["token_ids"].index(stop_id)
    stopped = dump(
        oai.completions.create(
            model="tiny-llama",
            prompt="Red green",
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]},
        ).choices[0]
    )
    assert stopped["token_ids"] == base["token_ids"][: first + 1]
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == stop_id
    held = dump(
        oai.completions.create(
            model="tiny-llama",
            prompt="Red green",
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True, "stop_token_ids": [stop_id], "min_tokens": first + 2},
        ).choices[0]
    )
    assert len(held["token_ids"]) >= first + 2, "min_tokens holds back a stop token"


def test_logprobs_top_five_in_openai_shape(oai):
    c = dump(
        oai.completions.create(
            model="tiny-llama", prompt="Numbers: 0 1", max_tokens=6, temperature=0, logprobs=5
        ).choices[0]
    )
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(c["token_ids"])
    for sampled, top in zip(lp["token_logprobs"], lp["top_logprobs"], strict=True):
        # Five alternatives, keyed by text as OpenAI's shape is: ids of partial UTF-8 bytes share one.
        assert len(top) == 5 or (len(top) < 5 and "\ufffd" in top), top
        assert max(top.values()) == pytest.approx(sampled, abs=1e-4), "greedy samples the most likely token"
    assert lp["text_offset"] == sorted(lp["text_offset"])


def test_vllm_fields_token_ids_as_tokens_and_prompt_logprobs(oai):
    """The fields vLLM's clients send (TRL's generate and get_sequence_logprobs, SkyRL's salt),
    answered in vLLM's shapes (docs/http_api.md#vllm-request-fields)."""
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True, "cache_salt": "version-0"}
    c = dump(
        oai.completions.create(
            model="tiny-llama",
            prompt="The quick brown fox jumps",
            max_tokens=5,
            temperature=0,
            logprobs=0,
            extra_body={**extra, "prompt_logprobs": 3},
        ).choices[0]
    )
    lp = c["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
    # logprobs 0: each position's top_logprobs holds the sampled token alone, as vLLM answers.
    sampled = zip(c["token_ids"], lp["token_logprobs"], strict=True)
    assert lp["top_logprobs"] == [{f"token_id:{t}": v} for t, v in sampled]
    prompt, plp = c["prompt_token_ids"], c["prompt_logprobs"]
    assert len(plp) == len(prompt) and plp[0] is None
    for token, position in zip(prompt[1:], plp[1:], strict=True):
        own = position[str(token)]
        assert own["decoded_token"] == f"token_id:{token}" and own["rank"] >= 1
        by_rank = sorted(position.values(), key=lambda e: e["rank"])
        assert [e["rank"] for e in by_rank][:3] == [1, 2, 3], position
        assert [e["logprob"] for e in by_rank] == sorted((e["logprob"] for e in by_rank), reverse=True)
        assert (own["rank"] == 1) == (own["logprob"] == by_rank[0]["logprob"])
        assert len(position) in (3, 4), "the top 3, and the prompt's token when it is not among them"
    # The same values as the echoed prompt's logprobs.
    echoed = dump(
        oai.completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=0
        ).choices[0]
    )["logprobs"]["token_logprobs"][: len(prompt)]
    assert echoed[0] is None
    for token, position, value in zip(prompt[1:], plp[1:], echoed[1:], strict=True):
        assert position[str(token)]["logprob"] == pytest.approx(value, abs=1e-4)


def test_prompt_logprobs_are_not_streamed(http):
    body = {"model": "tiny-llama", "prompt": "One two", "max_tokens": 2, "stream": True, "prompt_logprobs": 1}
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 422, resp.text
    assert "prompt_logprobs" in resp.text and "stream" in resp.text, resp.text


def test_echo_prepends_the_prompt_with_its_logprobs(oai):
    prompt = "The quick brown fox"
    c = dump(
        oai.completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1
        ).choices[0]
    )
    assert c["text"].startswith(prompt)
    n_prompt = len(c["prompt_token_ids"])
    lp = c["logprobs"]
    assert len(lp["tokens"]) == n_prompt + len(c["token_ids"])
    assert lp["token_logprobs"][0] is None and all(v is not None and v <= 0 for v in lp["token_logprobs"][1:])


def test_streaming_matches_the_full_answer_and_reports_usage(oai, http):
    kwargs = {
        "model": "tiny-llama",
        "prompt": ["One two three", "Red green"],
        "n": 2,
        "max_tokens": 16,
        "seed": 5,
        "logprobs": 1,
    }
    full = oai.completions.create(**kwargs)
    stream = oai.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    texts: dict[int, str] = {}
    tokens: dict[int, list[int]] = {}
    last: dict[int, dict] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for ch in map(dump, chunk.choices):
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
            tokens.setdefault(ch["index"], []).extend(ch["token_ids"])
            if ch["finish_reason"] is not None:
                last[ch["index"]] = ch
    assert sorted(texts) == [0, 1, 2, 3]
    for c in map(dump, full.choices):
        i = c["index"]
        assert texts[i] == c["text"] and tokens[i] == c["token_ids"]
        assert last[i]["finish_reason"] == c["finish_reason"]
        assert last[i]["weight_versions"] == c["weight_versions"]
        spans_cover(last[i], len(tokens[i]))
    assert usage is not None and usage.completion_tokens == sum(len(t) for t in tokens.values())
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_with_the_template(oai, tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "One two three"}]
    resp = oai.chat.completions.create(
        model="tiny-llama", messages=messages, max_tokens=8, temperature=0, n=2, logprobs=True, top_logprobs=3
    )
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    assert resp.object == "chat.completion"
    for c in map(dump, resp.choices):
        assert c["message"]["role"] == "assistant"
        assert c["prompt_token_ids"] == list(rendered)
        assert c["message"]["content"] == tok.decode(c["token_ids"], skip_special_tokens=True)
        assert len(c["logprobs"]["content"]) == len(c["token_ids"])
        assert all(len(t["top_logprobs"]) == 3 for t in c["logprobs"]["content"])
        spans_cover(c)
    assert resp.usage.prompt_tokens == len(rendered)
    assert dump(resp)["prompt_token_ids"] == list(rendered), "where vLLM's chat answer puts them"
    streamed = oai.chat.completions.create(
        model="tiny-llama", messages=messages, max_tokens=8, temperature=0, stream=True
    )
    content, roles = "", []
    for chunk in streamed:
        for ch in chunk.choices:
            roles += [ch.delta.role] if ch.delta.role else []
            content += ch.delta.content or ""
    assert roles == ["assistant"] and content == resp.choices[0].message.content
