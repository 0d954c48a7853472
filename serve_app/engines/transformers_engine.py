"""`engine: transformers`, the embedded default: HF transformers + torch in the replica's process.

Batched generation runs on the engine's control thread (`steps_on_control_thread`): each
forward pass (a batch's prefill, or one decode step of the batch) is one engine step, run inside
the profiling session's `forward_step` range, which names the profiled step and the weight
version, and only while admission is open. Profiled in process (torch, npu or nsys).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import LlamaForCausalLM
from transformers.cache_utils import DynamicCache

from profiling.backends.base import ProfilerBackend
from profiling.session import SessionSpec, in_process_backend
from serve_app.config import AppArgs
from serve_app.engines.base import GenerateRequest, GenerateResult, RolloutEngine
from serve_app.weights import StateDict, WeightsError, read_state_dict

log = logging.getLogger(__name__)


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
    next_input: torch.Tensor
    position_ids: torch.Tensor


class TransformersEngine(RolloutEngine[StateDict]):
    """The embedded engine: forward passes on the control thread, profiled in process."""

    steps_on_control_thread = True

    def _open(self, args: AppArgs, model_dir: Path) -> None:
        torch.set_num_threads(1)  # replicas share few cores; one intra-op thread each
        self._max_batch = args.transformers.max_batch_size
        self._model = LlamaForCausalLM.from_pretrained(model_dir).eval()
        self._eos = self._tokenizer.eos_token_id
        self._pad = self._tokenizer.pad_token_id
        params = inspect.signature(self._model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._forwards_by_version: dict[int, int] = {}
        self._pending: deque[_Sequence] = deque()
        self._pending_lock = threading.Lock()
        self._batch: _Batch | None = None
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="weights")

    @property
    def vocab_size(self) -> int:
        return int(self._model.config.vocab_size)

    # -- generation --------------------------------------------------------------------------
    async def _generate(self, request: GenerateRequest) -> GenerateResult:
        gen = torch.Generator().manual_seed(request.seed) if request.seed is not None else None
        seq = _Sequence(request, Future(), gen)
        with self._pending_lock:
            self._pending.append(seq)
        self._thread.wake()
        return await asyncio.wrap_future(seq.future)

    def _engine_step(self) -> bool:
        """Control thread: one forward pass of the current batch, or the prefill of a new one."""
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

    # -- profiling and weights ------------------------------------------------------------------
    def _profiler(self, spec: SessionSpec) -> ProfilerBackend:
        return in_process_backend(spec)

    async def _pause(self) -> None:
        self._thread.admit(False)

    async def _resume(self) -> None:
        self._thread.admit(True)

    async def _read_weights(self, path: Path) -> StateDict:
        # On a thread of its own: the control thread may be finalizing the stop's recording.
        return await asyncio.wrap_future(self._reader.submit(read_state_dict, path))

    async def _load_weights(self, weights: StateDict, version: int) -> None:
        def load() -> None:
            self._check_state(weights)
            self._session.mark_weight_update(version, lambda: self._model.load_state_dict(weights, strict=True))

        await self._on_thread(load)

    def _check_state(self, state: StateDict) -> None:
        own = self._model.state_dict()
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        wrong = [k for k in own.keys() & state.keys() if own[k].shape != state[k].shape]
        if missing or unexpected or wrong:
            raise WeightsError(
                "weights do not fit the served model: "
                f"missing {missing[:3]}, unexpected {unexpected[:3]}, wrong shape {wrong[:3]}"
            )

    def _forward_steps_by_version(self) -> dict[int, int]:
        return dict(self._forwards_by_version)

    def _healthy(self) -> bool:
        return True

    async def _close(self) -> None:
        self._reader.shutdown(wait=False)
