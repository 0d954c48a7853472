"""The embedded default engine: HF transformers + torch, batched generation on one model thread.

Each forward pass (a batch's prefill, or one decode step of the batch) is one engine step: it
runs inside the profiling session's `forward_step` range, which names the profiled step and the
weight version, and it is only admitted while admission is open.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import LlamaForCausalLM
from transformers.cache_utils import DynamicCache

from profiling.session import ProfileSession, SessionSpec, StopOutcome
from serve_app.engines.base import GenerateRequest, GenerateResult, RolloutEngine
from serve_app.engines.model_thread import ModelThread
from serve_app.engines.tokenizer import HfTokenizerMixin
from serve_app.weights import WeightsError, read_state_dict

log = logging.getLogger(__name__)

# After a stop is acknowledged, how long the model thread waits for the event loop to take the
# answer, and then for the answer to be sent, before the finalize blocks the process.
_ACK_WAIT_S = 0.5
_ACK_GRACE_S = 0.02


@dataclass
class _Sequence:
    request: GenerateRequest
    future: Future
    generator: torch.Generator | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class _Batch:
    seqs: list[_Sequence]
    cache: DynamicCache
    attention_mask: torch.Tensor
    next_input: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None


class TransformersEngine(HfTokenizerMixin, RolloutEngine):
    def __init__(
        self,
        *,
        model_dir: Path,
        model_name: str,
        session: ProfileSession,
        max_batch_size: int = 16,
        hold_timeout_s: float = 60.0,
    ):
        self.model_name = model_name
        self._session = session
        self._max_batch = max_batch_size
        self._hold_timeout_s = hold_timeout_s
        torch.set_num_threads(1)  # replicas share few cores; one intra-op thread each
        self._load_tokenizer(model_dir)
        self._model = LlamaForCausalLM.from_pretrained(model_dir).eval()
        self._eos = self._tokenizer.eos_token_id
        self._pad = self._tokenizer.pad_token_id
        params = inspect.signature(self._model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.weight_version = 0
        self._forwards_by_version: dict[int, int] = {}
        self._pending: deque[_Sequence] = deque()
        self._pending_lock = threading.Lock()
        self._batch: _Batch | None = None
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="weights")
        self._thread = ModelThread(self._engine_step, self._session.check_deadline)

    @property
    def vocab_size(self) -> int:
        return self._model.config.vocab_size

    # -- generation --------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.check_prompt(request.prompt_token_ids)
        gen = torch.Generator().manual_seed(request.seed) if request.seed is not None else None
        seq = _Sequence(request, Future(), gen)
        with self._pending_lock:
            self._pending.append(seq)
        self._thread.wake()
        return await asyncio.wrap_future(seq.future)

    def _engine_step(self) -> bool:
        """Model thread: one forward pass of the current batch, or the prefill of a new one."""
        if self._batch is None:
            with self._pending_lock:
                if not self._pending:
                    return False
                seqs = [self._pending.popleft() for _ in range(min(self._max_batch, len(self._pending)))]
            self._batch = self._prefill_inputs(seqs)
        batch = self._batch
        try:
            with self._session.forward_step(self.weight_version), torch.inference_mode():
                out = self._model(
                    input_ids=batch.next_input,
                    attention_mask=batch.attention_mask,
                    position_ids=batch.position_ids,
                    use_cache=True,
                    logits_to_keep=1,
                    **{self._cache_kw: batch.cache},
                )
            v = self.weight_version
            self._forwards_by_version[v] = self._forwards_by_version.get(v, 0) + 1
            self._sample(batch, out.logits[:, -1, :].float())
        except Exception as e:  # noqa: BLE001 - fail this batch's requests, keep serving
            log.exception("engine step failed")
            for s in batch.seqs:
                if not s.future.done():
                    s.future.set_exception(e)
            self._batch = None
        return True

    def _prefill_inputs(self, seqs: list[_Sequence]) -> _Batch:
        width = max(len(s.request.prompt_token_ids) for s in seqs)
        ids = torch.full((len(seqs), width), self._pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            p = s.request.prompt_token_ids
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        return _Batch(
            seqs=seqs,
            cache=DynamicCache(),
            attention_mask=mask,
            next_input=ids,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
        )

    @staticmethod
    def _pick(logits: torch.Tensor, seq: _Sequence) -> int:
        t = seq.request.temperature
        if t == 0:
            return int(logits.argmax())
        probs = torch.softmax(logits / t, dim=-1)
        return int(torch.multinomial(probs, 1, generator=seq.generator))

    def _sample(self, batch: _Batch, logits: torch.Tensor) -> None:
        logprobs = torch.log_softmax(logits, dim=-1)
        next_ids = []
        for i, s in enumerate(batch.seqs):
            if s.finish_reason is not None:
                next_ids.append(self._pad)
                continue
            try:
                tok = self._pick(logits[i], s)
            except RuntimeError as e:  # this request's sampling broke: fail it, not the batch
                s.finish_reason = "error"
                s.future.set_exception(ValueError(f"sampling failed: {e}"))
                next_ids.append(self._pad)
                continue
            s.token_ids.append(tok)
            s.logprobs.append(float(logprobs[i, tok]))
            if self.weight_version not in s.weight_versions:
                s.weight_versions.append(self.weight_version)
            if tok == self._eos:
                s.finish_reason = "stop"
            elif len(s.token_ids) >= s.request.max_tokens:
                s.finish_reason = "length"
            next_ids.append(tok)
        for s in batch.seqs:
            if s.finish_reason is not None and not s.future.done():
                s.future.set_result(
                    GenerateResult(
                        token_ids=s.token_ids,
                        logprobs=s.logprobs,
                        finish_reason=s.finish_reason,
                        weight_versions=s.weight_versions,
                    )
                )
        if all(s.finish_reason is not None for s in batch.seqs):
            self._batch = None
            return
        batch.next_input = torch.tensor(next_ids, dtype=torch.long).unsqueeze(1)
        batch.attention_mask = torch.cat(
            [batch.attention_mask, torch.ones((len(batch.seqs), 1), dtype=torch.long)], dim=1
        )
        batch.position_ids = batch.position_ids[:, -1:] + 1

    # -- profiling ---------------------------------------------------------------------------
    async def _on_model_thread(self, fn):
        return await asyncio.wrap_future(self._thread.submit(fn))

    async def start_profile(self, spec: SessionSpec) -> bool:
        def start() -> bool:
            try:
                return self._session.start(spec, self.weight_version)
            finally:
                self._thread.resume()  # a start always ends an admission hold

        return await self._on_model_thread(start)

    async def stop_profile(self, step: int | None, pause: bool) -> StopOutcome:
        loop = asyncio.get_running_loop()
        acked: asyncio.Future[StopOutcome] = loop.create_future()
        delivered = threading.Event()

        def resolve(outcome: StopOutcome) -> None:
            if not acked.done():
                acked.set_result(outcome)
            delivered.set()

        def ack(outcome: StopOutcome) -> None:
            # The profiler's finalize holds the GIL for its whole duration: let the answer leave
            # this process first, then finalize (no forward pass can run in between).
            loop.call_soon_threadsafe(resolve, outcome)
            delivered.wait(_ACK_WAIT_S)
            time.sleep(_ACK_GRACE_S)

        def stop() -> StopOutcome:
            if pause:
                self._thread.pause(self._hold_timeout_s)
            if step is None:
                outcome = StopOutcome(step=None, stopped=False)
                loop.call_soon_threadsafe(resolve, outcome)
                return outcome
            return self._session.stop(step, on_closed=ack)

        done = asyncio.wrap_future(self._thread.submit(stop))
        await asyncio.wait([acked, done], return_when=asyncio.FIRST_COMPLETED)
        if acked.done():
            return acked.result()
        return done.result()  # raised before acknowledging (e.g. a conflict)

    async def update_weights(self, version: int, path: str | None, resume: bool) -> float:
        t0 = time.perf_counter()
        # Read the file off the model thread, overlapping any profiler finalize running there.
        state = (
            await asyncio.wrap_future(self._loader.submit(read_state_dict, Path(path)))
            if path
            else None
        )

        def apply() -> None:
            if state is not None and version != self.weight_version:
                self._check_state(state)
                self._session.mark_weight_update(
                    version, lambda: self._model.load_state_dict(state, strict=True)
                )
                self.weight_version = version
            if resume:
                self._thread.resume()
            else:  # hold for the /profile/start that follows: nothing runs unprofiled on `version`
                self._thread.pause(self._hold_timeout_s)

        await self._on_model_thread(apply)
        return time.perf_counter() - t0

    def _check_state(self, state: dict[str, torch.Tensor]) -> None:
        own = self._model.state_dict()
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        wrong = [k for k in own.keys() & state.keys() if own[k].shape != state[k].shape]
        if missing or unexpected or wrong:
            raise WeightsError(
                "weights do not fit the served model: "
                f"missing {missing[:3]}, unexpected {unexpected[:3]}, wrong shape {wrong[:3]}"
            )

    @property
    def paused(self) -> bool:
        return self._thread.paused

    def forward_steps_by_version(self) -> dict[int, int]:
        return dict(self._forwards_by_version)

    def healthy(self) -> bool:
        return self._thread.alive()

    async def shutdown(self) -> None:
        await asyncio.to_thread(self._thread.shutdown)
        self._loader.shutdown(wait=False)
