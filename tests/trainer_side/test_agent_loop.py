"""The AgentLoop rollout (trainer/agent_loop.py, `rollout.mode: agent_loop`).

Unit tests drive the episode logic against `FakeChatApp`, a stand-in for the app's
/v1/chat/completions that renders messages with the tiny model's template over a character
"tokenizer" and lets a test move the weight version between (or inside) turns. The integration
test runs the main job with `rollout.mode=agent_loop` and checks the episodes it recorded, that
their samples were trained on, and that the profiled steps still attribute every forward pass to
weights k-1.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import pytest

from serve_app.openai_api import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    TokenLogprob,
    Usage,
    WeightVersionSpan,
)
from trainer.agent_loop import AgentLoop, Episode, TurnRecord, environment_reply
from trainer.client import RolloutClient
from trainer.config import ConfigError, load_config
from trainer.policy import Sample

from .helpers import by_role, read_manifest
from .test_main_job import CLI_TIMEOUT_S, check_step, run_cli


def render(messages: Sequence[ChatMessage]) -> str:
    """The tiny model's chat template (serve_app/tiny_model.py), with the generation prompt."""
    return "".join(f"<s>{m.role}: {m.text()}</s>\n" for m in messages) + "<s>assistant:"


class FakeChatApp:
    """A fake of RolloutClient.chat: one token per character (its code point), answers
    `answer_len` tokens of " tick<n>", logprob -0.5 per token, sampled on `version`; a test sets
    `switch_at` to move to version+1 after that many tokens of the next answer (a sync landing
    mid-answer)."""

    def __init__(self, answer_len: int = 6, version: int = 0):
        self.answer_len = answer_len
        self.version = version
        self.switch_at: int | None = None
        self.requests: list[tuple[list[ChatMessage], dict[str, Any]]] = []
        self.gate: asyncio.Event | None = None
        """When set, calls after the first wait for it (to observe an episode mid-way)."""

    async def chat(self, messages: Sequence[ChatMessage | Mapping[str, Any]], **fields: Any) -> ChatCompletionResponse:
        msgs = [m if isinstance(m, ChatMessage) else ChatMessage.model_validate(m) for m in messages]
        self.requests.append((msgs, fields))
        await asyncio.sleep(0)  # a real call yields to the event loop
        if self.gate is not None and len(self.requests) > 1:
            await self.gate.wait()
        prompt_ids = [ord(c) for c in render(msgs)]
        text = f" tick{len(self.requests)}".ljust(self.answer_len)[: self.answer_len]
        ids = [ord(c) for c in text]
        spans = [WeightVersionSpan(version=self.version, start=0, end=len(ids))]
        oldest = self.version
        if self.switch_at is not None:
            spans = [
                WeightVersionSpan(version=self.version, start=0, end=self.switch_at),
                WeightVersionSpan(version=self.version + 1, start=self.switch_at, end=len(ids)),
            ]
            self.version += 1
            self.switch_at = None
        choice = ChatChoice(
            index=0,
            message=AssistantMessage(content=text),
            finish_reason="length",
            logprobs=ChatLogprobs(
                content=[TokenLogprob(token=c, logprob=-0.5, bytes=list(c.encode()), top_logprobs=[]) for c in text]
            ),
            token_ids=ids,
            prompt_token_ids=prompt_ids,
            weight_version=oldest,
            weight_versions=spans,
        )
        usage = Usage(
            prompt_tokens=len(prompt_ids), completion_tokens=len(ids), total_tokens=len(prompt_ids) + len(ids)
        )
        return ChatCompletionResponse(
            id="chat-1", created=0, model="tiny", choices=[choice], usage=usage, weight_version=oldest
        )


def share_of_k(ids: list[int]) -> float:
    return sum(t == ord("k") for t in ids) / len(ids)


def agent(app: FakeChatApp, **kw: Any) -> AgentLoop:
    args: dict[str, Any] = {
        "turns": 3,
        "max_tokens": 6,
        "temperature": 1.0,
        "reward": share_of_k,
        "tasks": ["Red green blue"],
    }
    args.update(kw)
    return AgentLoop(app, **args)


def test_an_episode_is_turns_of_chat_over_the_growing_conversation():
    app = FakeChatApp()
    episode = asyncio.run(agent(app).episode("Red green blue"))

    assert [r.turn for r in episode.turns] == [1, 2, 3]
    assert len(app.requests) == 3
    for (msgs, fields), record in zip(app.requests, episode.turns, strict=True):
        assert fields == {"max_tokens": 6, "temperature": 1.0, "logprobs": True}
        # turn t sees the task, then (answer, environment reply) for each earlier turn
        assert [m.role for m in msgs] == ["user"] + ["assistant", "user"] * (record.turn - 1)
        assert msgs[0].text() == "Red green blue"
        for earlier in episode.turns[: record.turn - 1]:
            assert msgs[2 * earlier.turn - 1].text() == earlier.text
            assert msgs[2 * earlier.turn].text() == environment_reply(earlier.turn, earlier)
    # the recorded conversation ends with the last answer (no reply after the last turn)
    assert [m.role for m in episode.messages] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    assert episode.messages[-1].text() == episode.turns[-1].text
    assert episode.ended == "turns"


def test_turn_two_prompt_holds_turn_one_prompt_and_answer():
    app = FakeChatApp()
    first, second, _ = asyncio.run(agent(app).episode("One two three")).turns
    assert second.prompt_token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids
    rest = second.prompt_token_ids[len(first.prompt_token_ids) :]
    # the template puts a space after "assistant:" before the answer's text
    assert rest[1 : 1 + len(first.token_ids)] == first.token_ids


def test_the_environment_reply_is_deterministic_from_turn_and_answer():
    record = TurnRecord(
        turn=1,
        prompt_token_ids=[1],
        token_ids=[5, 6, 7],
        logprobs=[0.0] * 3,
        text="abc",
        finish_reason="length",
        weight_version=0,
        weight_versions=[],
    )
    assert environment_reply(1, record) == environment_reply(1, record.model_copy())
    assert environment_reply(1, record) == "Observation 1: your answer had 3 tokens; say more about the answer."
    assert environment_reply(2, record) != environment_reply(1, record)


def test_each_turn_is_one_sample_with_its_own_prompt_answer_and_oldest_version():
    app = FakeChatApp()
    loop = agent(app)
    episode = asyncio.run(loop.episode("Red green blue"))
    samples = [loop.sample(r) for r in episode.turns]
    for s, r in zip(samples, episode.turns, strict=True):
        assert s == Sample(
            prompt_ids=r.prompt_token_ids,
            completion_ids=r.token_ids,
            logprobs=[-0.5] * len(r.token_ids),
            weight_version=r.weight_version,
            reward=share_of_k(r.token_ids),
        )
        assert s.reward > 0  # " tick.." holds one "k"


def test_an_episode_crosses_weight_syncs_and_records_each_turns_spans():
    app = FakeChatApp(answer_len=6, version=4)

    async def on_turn(record: TurnRecord) -> None:
        if record.turn == 1:
            app.version = 5  # a sync between turn 1 and turn 2
        if record.turn == 2:
            app.switch_at = 2  # a sync landing two tokens into turn 3's answer

    episode = asyncio.run(agent(app).episode("Red green blue", on_turn=on_turn))
    t1, t2, t3 = episode.turns
    assert (t1.weight_version, t2.weight_version, t3.weight_version) == (4, 5, 5)
    assert [(s.version, s.start, s.end) for s in t1.weight_versions] == [(4, 0, 6)]
    assert [(s.version, s.start, s.end) for s in t2.weight_versions] == [(5, 0, 6)]
    assert [(s.version, s.start, s.end) for s in t3.weight_versions] == [(5, 0, 2), (6, 2, 6)]


def test_finished_episodes_are_recorded_as_json_lines(tmp_path):
    path = tmp_path / "run" / "episodes.jsonl"
    loop = agent(FakeChatApp(), turns=2, episodes_path=path)

    async def two() -> list[Episode]:
        return [await loop.episode("A", worker=1, index=0), await loop.episode("B", worker=1, index=1)]

    episodes = asyncio.run(two())
    lines = path.read_text().splitlines()
    assert [Episode.model_validate_json(line) for line in lines] == episodes
    assert [json.loads(line)["messages"][0]["content"] for line in lines] == ["A", "B"]


def test_an_episode_ends_early_when_the_next_turn_might_not_fit_the_context():
    app = FakeChatApp()
    first_prompt = len(render([ChatMessage(role="user", content="Red green blue")]))
    # room for turn 1 (prompt + 6 tokens) but not for a reply and the template's markup on top
    episode = asyncio.run(agent(app, context_len=first_prompt + 40).episode("Red green blue"))
    assert episode.ended == "context" and len(episode.turns) == 1 and len(app.requests) == 1
    assert [m.role for m in episode.messages] == ["user", "assistant"]
    roomy = asyncio.run(agent(FakeChatApp(), context_len=4096).episode("Red green blue"))
    assert roomy.ended == "turns" and len(roomy.turns) == 3


def test_producers_put_each_turn_on_the_queue_as_it_is_answered():
    """A turn's sample is trainable before its episode ends (episodes span syncs); workers take
    tasks in turn."""
    app = FakeChatApp()
    gate = app.gate = asyncio.Event()
    loop = agent(app, tasks=["A", "B", "C"])

    async def go() -> tuple[Sample, int, list[str]]:
        queue: asyncio.Queue[Sample] = asyncio.Queue()
        worker = asyncio.create_task(loop.produce(0, queue))
        first = await asyncio.wait_for(queue.get(), 5)
        pending = queue.qsize()  # turn 2 is held at the gate
        gate.set()
        while len({m[0].text() for m, _ in app.requests}) < 3:
            await asyncio.sleep(0)
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
        return first, pending, [m[0].text() for m, _ in app.requests]

    first, pending, opening = asyncio.run(go())
    assert first.completion_ids == [ord(c) for c in " tick1"] and pending == 0
    assert opening[:7] == ["A", "A", "A", "B", "B", "B", "C"]


def test_an_answer_without_one_logprob_per_token_is_refused():
    class ShortLogprobs(FakeChatApp):
        async def chat(self, messages: Sequence[Any], **fields: Any) -> ChatCompletionResponse:
            resp = await super().chat(messages, **fields)
            assert resp.choices[0].logprobs is not None
            resp.choices[0].logprobs.content.pop()
            return resp

    with pytest.raises(ValueError, match="turn 1: 5 logprobs for 6 answer tokens"):
        asyncio.run(agent(ShortLogprobs()).episode("A"))


def test_config_selects_the_mode_and_validates_the_agent_keys(tmp_path):
    assert load_config("config/trainer.yaml").rollout.mode == "completions"
    cfg = load_config(
        None, ["rollout.mode=agent_loop", "rollout.agent_turns=2", f"rollout.agent_episodes_path={tmp_path}/e.jsonl"]
    )
    assert (cfg.rollout.mode, cfg.rollout.agent_turns) == ("agent_loop", 2)
    with pytest.raises(ConfigError, match=re.escape("rollout.mode")):
        load_config(None, ["rollout.mode=agents"])
    with pytest.raises(ConfigError, match=re.escape("rollout.agent_turns")):
        load_config(None, ["rollout.mode=agent_loop", "rollout.agent_turns=0"])
    with pytest.raises(ConfigError, match="episodes are only recorded with mode agent_loop"):
        load_config(None, [f"rollout.agent_episodes_path={tmp_path}/e.jsonl"])


def test_client_chat_posts_only_the_fields_it_was_given():
    """RolloutClient.chat on a fake transport: OpenAI's body with the caller's fields only (a
    default sent explicitly would count as set for the ingress's unsupported-field check)."""
    seen: list[httpx.Request] = []
    answer = asyncio.run(FakeChatApp().chat([ChatMessage(role="user", content="hi")]))

    def fake_app(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=answer.model_dump(mode="json"))

    async def go() -> ChatCompletionResponse:
        client = RolloutClient("http://127.0.0.1:1")
        client._http = httpx.AsyncClient(base_url="http://127.0.0.1:1", transport=httpx.MockTransport(fake_app))
        async with client:
            return await client.chat([{"role": "user", "content": "hi"}], max_tokens=4, logprobs=True)

    assert asyncio.run(go()) == answer
    [request] = seen
    assert request.url.path == "/v1/chat/completions"
    assert json.loads(request.content) == {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "logprobs": True,
    }


# -- the main job in agent-loop mode -------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(CLI_TIMEOUT_S + 120)
def test_main_job_in_agent_loop_mode_trains_on_turns_and_keeps_attribution(tmp_path):
    """`rollout.mode=agent_loop`: 3-turn episodes through /v1/chat/completions feed training, the
    episodes recorded show each turn's prompt holding the conversation so far, and profiled steps
    1 and 2 hold only forward passes on weights k-1 (check_step, as for the default main job)."""
    from transformers import AutoTokenizer

    from serve_app.tiny_model import ensure_tiny_model

    episodes_path = tmp_path / "episodes.jsonl"
    run = run_cli(
        tmp_path,
        "rollout.mode=agent_loop",
        "rollout.agent_turns=3",
        f"rollout.agent_episodes_path={episodes_path}",
        "rollout.max_tokens=8",
        "trainer.total_versions=3",
        "trainer.mini_batch_size=8",
        "trainer.trigger_parameter_sync_step=1",
        "global_profiler.steps=[1,2]",
    )
    assert run.returncode == 0, run.log
    for k in (1, 2):
        check_step(run, k)
        manifest = read_manifest(run.profile, k)
        assert manifest is not None  # check_step read it
        [trainer] = by_role(manifest, "trainer")
        assert trainer["staleness"]["samples"] > 0, trainer  # turns' samples reached training in step k

    episodes = [Episode.model_validate_json(line) for line in episodes_path.read_text().splitlines()]
    finished = [e for e in episodes if e.ended == "turns"]
    assert finished, f"no episode ran its 3 turns: {[e.ended for e in episodes]}"
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())  # the model the job's app served
    for e in finished:
        assert [t.turn for t in e.turns] == [1, 2, 3]
        assert [m.role for m in e.messages] == ["user", "assistant", "user", "assistant", "user", "assistant"]
        for t in e.turns:
            # the prompt the server rendered is the conversation so far, the earlier answers in it
            rendered = tokenizer.decode(t.prompt_token_ids, skip_special_tokens=False)
            assert rendered == render(e.messages[: 2 * t.turn - 1]), (t.turn, rendered)
            assert t.weight_versions and t.weight_versions[0].start == 0
            assert t.weight_versions[-1].end == len(t.token_ids) == len(t.logprobs)
            assert t.weight_version == min(s.version for s in t.weight_versions)
        first, second, third = e.turns
        assert second.prompt_token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids
        assert third.prompt_token_ids[: len(second.prompt_token_ids)] == second.prompt_token_ids
        assert f"<s>assistant: {first.text}</s>" in tokenizer.decode(second.prompt_token_ids)
        # versions only move forward within an episode (it may cross syncs)
        assert first.weight_version <= second.weight_version <= third.weight_version
