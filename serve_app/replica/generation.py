"""The replica's data plane: generation, admitted through the replica's own gate
(serve_app/admission.py) so that control calls never wait for it, and tokenization (vLLM's
/tokenize and /detokenize: no engine step, so no gate)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from serve_app.admission import GenerationGate
from serve_app.async_streams import merged
from serve_app.choices import ChoiceBuilder, JobAccepted, JobDone, JobResult, PromptJob, choice_index, sampling_for
from serve_app.engines.controller import EngineController
from serve_app.engines.generation import GenerateRequest, check_fits, room_left
from serve_app.openai_api import ChatChunkChoice, ChatCompletionRequest, CompletionChunkChoice
from serve_app.tokenize_api import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)

INLINE_TOKENIZE_CHARS = 1024
"""Text prompts up to this long are tokenized on the event loop (about 0.2 ms at this length with
a fast tokenizer): the hop to a thread and back costs more than that under load (a tenth of a
replica's CPU per request at 1024 clients); longer ones go to a thread."""


class GenerationPlane:
    """Generation methods of the replica deployment, load balanced by Serve's router (and called
    in-process by the replica listener)."""

    engine: EngineController
    _gate: GenerationGate

    async def run_jobs(self, jobs: list[PromptJob]) -> list[JobResult]:
        """Prompts of one request, each with its `n` choices, whole. One call carries several
        prompts: a handle call costs more than a prompt's bookkeeping."""
        async with self._gate.admit():
            return list(await asyncio.gather(*(self._run_job(j) for j in jobs)))

    async def _run_job(self, job: PromptJob) -> JobResult:
        builders, requests = await self._prepare(job, stream=False)

        async def run(builder: ChoiceBuilder, request: GenerateRequest) -> None:
            async for delta in self.engine.generate(request):
                builder.feed(delta)

        await asyncio.gather(*(run(b, r) for b, r in zip(builders, requests, strict=True)))
        return JobResult(
            choices=[b.choice() for b in builders],
            prompt_tokens=len(builders[0].prompt_ids),
            completion_tokens=sum(len(b.token_ids) for b in builders),
        )

    async def stream_jobs(
        self, jobs: list[PromptJob]
    ) -> AsyncIterator[JobAccepted | CompletionChunkChoice | ChatChunkChoice | JobDone]:
        """Prompts of one request as stream pieces: `JobAccepted` once every prompt fits and its
        sequences are queued, then pieces as the engine makes tokens, then `JobDone`. Closing
        the stream (the caller went away) aborts every sequence still running."""
        async with self._gate.admit():
            prepared = [await self._prepare(j, stream=True) for j in jobs]
            builders = [b for bs, _ in prepared for b in bs]
            requests = [r for _, rs in prepared for r in rs]
            yield JobAccepted(prompt_tokens=sum(len(bs[0].prompt_ids) for bs, _ in prepared))
            async for i, delta in merged(self.engine.generate(r) for r in requests):
                if (piece := builders[i].piece(delta)) is not None:
                    yield piece
            yield JobDone(completion_tokens=sum(len(b.token_ids) for b in builders))

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        """A prompt's or a conversation's token ids, as generation would take them. ValueError: a 422."""
        tokenizer = self.engine.tokenizer
        if isinstance(request, TokenizeChatRequest):
            messages = [{"role": m.role, "content": m.text()} for m in request.messages]
            ids = await asyncio.to_thread(tokenizer.chat_prompt, messages, request.add_generation_prompt)
        else:
            ids = await asyncio.to_thread(tokenizer.tokenize, request.prompt, request.add_special_tokens)
        return TokenizeResponse(
            count=len(ids),
            max_model_len=self.engine.context_length,
            tokens=ids,
            token_strs=tokenizer.vocab_strings(ids) if request.return_token_strs else None,
        )

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        """The text of token ids, special tokens kept. ValueError (a 422): an id the model cannot embed."""
        tokenizer = self.engine.tokenizer
        tokenizer.check_prompt(request.tokens)
        return DetokenizeResponse(prompt=await asyncio.to_thread(tokenizer.prompt_text, request.tokens))

    async def _prepare(self, job: PromptJob, stream: bool) -> tuple[list[ChoiceBuilder], list[GenerateRequest]]:
        """Tokenize (a long prompt off the event loop: it must not stall control calls and health
        checks), check the prompt fits, and build each choice's request. ValueError: a 422."""
        engine, request = self.engine, job.request
        if isinstance(request, ChatCompletionRequest):
            messages = [{"role": m.role, "content": m.text()} for m in request.messages]
            prompt_ids = await asyncio.to_thread(engine.tokenizer.chat_prompt, messages, request.add_generation_prompt)
        elif isinstance(job.prompt, str) and len(job.prompt) <= INLINE_TOKENIZE_CHARS:
            prompt_ids = engine.tokenizer.tokenize(job.prompt)
        elif isinstance(job.prompt, str):
            prompt_ids = await asyncio.to_thread(engine.tokenizer.tokenize, job.prompt)
        else:
            prompt_ids = list(job.prompt or [])
        if not prompt_ids:
            raise ValueError("prompt is empty after tokenization")
        engine.tokenizer.check_prompt(prompt_ids)
        max_tokens = request.output_limit()
        if max_tokens is None:
            max_tokens = room_left(engine.context_length, len(prompt_ids))
        else:
            check_fits(engine.context_length, len(prompt_ids), max_tokens)
        text = job.prompt if isinstance(job.prompt, str) else None
        builders, requests = [], []
        for i in range(request.n):
            index = choice_index(request, job.prompt_index, i)
            builders.append(ChoiceBuilder(engine.tokenizer, request, index, prompt_ids, text, engine.weight_version))
            requests.append(
                GenerateRequest(
                    prompt_token_ids=prompt_ids,
                    sampling=sampling_for(request, job.prompt_index, i, max_tokens),
                    stream=stream,
                    cache_salt=request.cache_salt,
                    names=job.names,
                )
            )
        return builders, requests
