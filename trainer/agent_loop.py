"""The AgentLoop rollout (`rollout.mode: agent_loop`): multi-turn chat episodes on the trainer side.

An episode is a k-turn conversation through `/v1/chat/completions`. Turn t is one chat
completion over the conversation so far; its answer is appended as an assistant message, then a
scripted environment's reply (deterministic from the turn and the answer, like a tool's
observation) as a user message, and the next turn starts. Episodes cross weight syncs freely:
turn 1 may be sampled on version v and turn 2 on v+1; each turn records its own versions.

Each turn is one training `Sample`: the prompt the server rendered (chat template applied) and the
answer's token ids, as the server reports them, so the trainer never re-tokenizes. The next turn's
prompt is rendered from the conversation's text, so it may tokenize the earlier answer differently
from how it was sampled; per-turn samples stay exact regardless (docs/trainer.md#the-agent-loop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel

from serve_app.openai_api import ChatChoice, ChatCompletionResponse, ChatMessage, WeightVersionSpan
from trainer.policy import Sample

Reward = Callable[[list[int]], float]
"""A turn's reward from its answer's token ids."""

TOPICS = ("the rollout", "the weights", "the trainer", "the replica", "the answer")
"""What the scripted environment asks about next."""

TEMPLATE_SLACK_TOKENS = 32
"""Tokens allowed for the chat template's markup around two new messages (role names, separators)
when judging whether the next turn still fits the model's context."""


class ChatClient(Protocol):
    """What the agent loop needs of the rollout client (RolloutClient.chat)."""

    async def chat(
        self, messages: Sequence[ChatMessage | Mapping[str, Any]], **fields: Any
    ) -> ChatCompletionResponse: ...


class TurnRecord(BaseModel):
    """One turn of an episode: what the server conditioned on and what it sampled."""

    turn: int
    """1-based."""
    prompt_token_ids: list[int]
    """The rendered conversation so far (chat template and generation prompt applied)."""
    token_ids: list[int]
    """The answer."""
    logprobs: list[float]
    """The sampled tokens' logprobs, one per answer token."""
    text: str
    finish_reason: str
    weight_version: int
    """The oldest version that sampled a token of the answer."""
    weight_versions: list[WeightVersionSpan]
    """Spans over `token_ids` with the version that sampled them (two when a sync landed mid-answer)."""


class Episode(BaseModel):
    """A finished conversation, as recorded to `rollout.agent_episodes_path`."""

    worker: int
    index: int
    """The worker's episode counter (0-based)."""
    messages: list[ChatMessage]
    """The whole conversation: the task, then each answer and environment reply."""
    turns: list[TurnRecord]
    ended: Literal["turns", "context"]
    """`turns`: all turns ran; `context`: the next turn might not have fit the model's context."""


def environment_reply(turn: int, record: TurnRecord) -> str:
    """The scripted environment's observation after `turn`: deterministic from the turn and the
    answer, so an episode's conversation can be checked after the fact."""
    topic = TOPICS[(turn + len(record.token_ids)) % len(TOPICS)]
    return f"Observation {turn}: your answer had {len(record.token_ids)} tokens; say more about {topic}."


class AgentLoop:
    """Runs episodes and turns their turns into training samples; one instance serves every
    producer of the job (`produce` once per worker)."""

    def __init__(
        self,
        client: ChatClient,
        *,
        turns: int,
        max_tokens: int,
        temperature: float,
        reward: Reward,
        tasks: Sequence[str],
        context_len: int | None = None,
        episodes_path: Path | None = None,
    ):
        """`tasks`: the opening user messages, taken in turn. `context_len`: the served model's
        context in tokens (None: unknown, every episode runs all its turns). `episodes_path`:
        a JSON-lines file every finished episode is appended to."""
        if turns < 1 or not tasks:
            raise ValueError(f"an agent loop needs at least one turn and one task (turns={turns}, {len(tasks)} tasks)")
        self.client = client
        self.turns = turns
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.reward = reward
        self.tasks = list(tasks)
        self.context_len = context_len
        self.episodes_path = episodes_path
        if episodes_path is not None:
            episodes_path.parent.mkdir(parents=True, exist_ok=True)

    async def episode(
        self,
        task: str,
        *,
        worker: int = 0,
        index: int = 0,
        on_turn: Callable[[TurnRecord], Awaitable[None]] | None = None,
    ) -> Episode:
        """Run one conversation opening with `task`; `on_turn` is awaited with each turn as soon
        as it is answered."""
        messages = [ChatMessage(role="user", content=task)]
        records: list[TurnRecord] = []
        ended: Literal["turns", "context"] = "turns"
        for turn in range(1, self.turns + 1):
            answer = await self.client.chat(
                list(messages), max_tokens=self.max_tokens, temperature=self.temperature, logprobs=True
            )
            record = _record(turn, answer)
            records.append(record)
            messages.append(ChatMessage(role="assistant", content=record.text))
            if on_turn is not None:
                await on_turn(record)
            if turn == self.turns:
                break
            reply = environment_reply(turn, record)
            if not self._next_turn_fits(record, reply):
                ended = "context"
                break
            messages.append(ChatMessage(role="user", content=reply))
        episode = Episode(worker=worker, index=index, messages=messages, turns=records, ended=ended)
        if self.episodes_path is not None:
            with self.episodes_path.open("a") as f:  # one short line: no other writer interleaves
                f.write(episode.model_dump_json() + "\n")
        return episode

    def _next_turn_fits(self, last: TurnRecord, reply: str) -> bool:
        """Whether the next prompt plus `max_tokens` surely fits the context: the next prompt is
        the last one plus the answer's text and the reply, re-rendered, and a token covers at
        least one byte of text, so their UTF-8 bytes bound their tokens."""
        if self.context_len is None:
            return True
        added = len(last.text.encode()) + len(reply.encode()) + TEMPLATE_SLACK_TOKENS
        return len(last.prompt_token_ids) + added + self.max_tokens <= self.context_len

    def sample(self, record: TurnRecord) -> Sample:
        """The training sample of one turn: its prompt, its answer, its oldest version."""
        return Sample(
            prompt_ids=record.prompt_token_ids,
            completion_ids=record.token_ids,
            logprobs=record.logprobs,
            weight_version=record.weight_version,
            reward=self.reward(record.token_ids),
        )

    async def produce(self, worker: int, queue: asyncio.Queue[Sample]) -> None:
        """Run episodes forever, putting each turn's sample on `queue` as the turn is answered."""

        async def put(record: TurnRecord) -> None:
            await queue.put(self.sample(record))

        index = 0
        while True:
            task = self.tasks[(worker + index) % len(self.tasks)]
            await self.episode(task, worker=worker, index=index, on_turn=put)
            index += 1


def _record(turn: int, answer: ChatCompletionResponse) -> TurnRecord:
    if len(answer.choices) != 1:
        raise ValueError(f"turn {turn}: expected one choice, the app answered {len(answer.choices)}")
    choice: ChatChoice = answer.choices[0]
    if choice.logprobs is None:
        raise ValueError(f"turn {turn}: the app answered without logprobs although the request asked for them")
    logprobs = [t.logprob for t in choice.logprobs.content]
    if len(logprobs) != len(choice.token_ids):
        raise ValueError(
            f"turn {turn}: {len(logprobs)} logprobs for {len(choice.token_ids)} answer tokens; the trainer needs "
            "one per token"
        )
    return TurnRecord(
        turn=turn,
        prompt_token_ids=choice.prompt_token_ids,
        token_ids=choice.token_ids,
        logprobs=logprobs,
        text=choice.message.content,
        finish_reason=choice.finish_reason,
        weight_version=choice.weight_version,
        weight_versions=choice.weight_versions,
    )
