"""`engine: transformers`, the embedded default: HF transformers + torch in the replica's process.

Batched generation runs on the engine's control thread (`steps_on_control_thread`): each
forward pass (a batch's prefill, or one decode step of the batch) is one engine step, run inside
the profiling session's `forward_step` range, which names the profiled step and the weight
version, and only while admission is open. Profiled in process (torch, npu or nsys).

Each request is one sequence (serve_app/engines/generation.py): it waits in a pending queue until
the running batch ends, then joins the next batch's prefill. After each forward pass the sampler
(serve_app/engines/transformers/sampler.py) picks every sequence's token, and the control thread hands the
sequence's deltas to the request's event loop, each tagged with the weight version of the pass
that produced it. A consumer that goes away marks its sequence aborted; the next engine step
drops it from the batch (a batch whose sequences all ended ends). An abort the app asks for
(`abort`) runs on the control thread between two engine steps: each sequence it names gets its
last deltas at once, finish_reason 'abort' with the tokens not sent yet, and is dropped likewise.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
from collections import deque
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import LlamaForCausalLM
from transformers.cache_utils import DynamicCache

from profiling.backends.base import ProfilerBackend
from profiling.session import SessionSpec, in_process_backend
from serve_app.config import AppArgs
from serve_app.engines.adapter import EngineAdapter, PassCounts
from serve_app.engines.generation import GenerateDelta, GenerateRequest, TokenLogprobs
from serve_app.engines.transformers.options import TransformersOptions
from serve_app.engines.transformers.sampler import Finish, Sampled, SequenceSampler, prompt_logprobs, sample_batch
from serve_app.weights import collective as weight_wire
from serve_app.weights.checkpoint import StateDict, read_state_dict
from serve_app.weights.collective_schema import CollectiveTransfer
from serve_app.weights.safetensors_file import WeightsError

log = logging.getLogger(__name__)

_Item = list[GenerateDelta] | BaseException
"""What the control thread hands one sequence's consumer: its next deltas, or why it failed."""


@dataclass(eq=False)
class _Sequence:
    """One request's sequence: filled on the control thread, consumed on the event loop."""

    request: GenerateRequest
    sampler: SequenceSampler
    loop: asyncio.AbstractEventLoop
    channel: asyncio.Queue[_Item]
    aborted: bool = False
    """Set by the consumer that went away: the control thread drops the sequence at its next step."""
    finished: bool = False
    """Set on the control thread once its last delta (or its error) is sent."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    sent_any: bool = False
    runs: list[GenerateDelta] = field(default_factory=list)
    """With `stream` False: the output so far, one delta per run of one weight version."""

    @property
    def live(self) -> bool:
        return not (self.finished or self.aborted)

    def delta(self, sampled: Sampled, version: int, finish: Finish | None) -> list[GenerateDelta] | None:
        """Record one new token sampled with `version`; the deltas to send now, if any."""
        first = not self.sent_any and not self.runs
        if self.request.stream or first or self.runs[-1].weight_version != version:
            delta = GenerateDelta(weight_version=version, prompt_logprobs=self.prompt_logprobs if first else None)
            if not self.request.stream:
                self.runs.append(delta)
        else:
            delta = self.runs[-1]
        delta.token_ids.append(sampled.token_id)
        if sampled.logprobs is not None:
            delta.logprobs.append(sampled.logprobs)
        if finish is not None:
            delta.finish_reason, delta.stop_reason = finish.reason, finish.stop_reason
        if self.request.stream:
            self.sent_any = True
            return [delta]
        return self.runs if finish is not None else None

    def abort_deltas(self) -> list[GenerateDelta]:
        """The last deltas of a sequence the app ends early: finish_reason 'abort' on the output
        not sent yet (streamed: all was sent), one delta per run of one weight version."""
        if self.request.stream or not self.runs:
            return [GenerateDelta(finish_reason="abort")]
        self.runs[-1].finish_reason = "abort"
        return self.runs


@dataclass
class _Batch:
    seqs: list[_Sequence]
    cache: DynamicCache
    attention_mask: torch.Tensor
    next_input: torch.Tensor
    position_ids: torch.Tensor
    all_logits: bool = False
    """This forward pass keeps the logits of every position (a prefill asked for prompt logprobs)."""


class TransformersEngine(EngineAdapter):
    """The embedded engine: forward passes on the control thread, profiled in process."""

    steps_on_control_thread = True

    def open(self, args: AppArgs, model_dir: Path) -> None:
        torch.set_num_threads(1)  # replicas share few cores; one intra-op thread each
        opts = args.engine_options
        assert isinstance(opts, TransformersOptions)
        self._max_batch = opts.max_batch_size
        self._model = LlamaForCausalLM.from_pretrained(model_dir).eval()
        self.host.tokenizer.vocab_size = int(self._model.config.vocab_size)
        self._eos = self.host.tokenizer.eos_token_id
        # Pads only positions the attention mask hides: any id does where the tokenizer has none.
        self._pad = self.host.tokenizer.pad_token_id or 0
        params = inspect.signature(self._model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._forwards_by_version: dict[int, int] = {}
        self._pending: deque[_Sequence] = deque()
        self._pending_lock = threading.Lock()
        self._batch: _Batch | None = None
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="weights")
        self._staged: StateDict | None = None
        """Weights a collective transfer delivered, until they load or the transfer is dropped."""

    # -- generation --------------------------------------------------------------------------
    async def stream(self, request: GenerateRequest) -> AsyncGenerator[GenerateDelta, None]:
        """Deltas of one sequence: one per engine step with `request.stream`, else one per run of
        one weight version, all sent when the sequence ends."""
        sampler = SequenceSampler(request.sampling, request.prompt_token_ids, self._eos, self.host.tokenizer.vocab_size)
        seq = _Sequence(request, sampler, asyncio.get_running_loop(), asyncio.Queue())
        with self._pending_lock:
            self._pending.append(seq)
        self.host.thread.wake()
        try:
            while True:
                item = await seq.channel.get()
                if isinstance(item, BaseException):
                    raise item
                for delta in item:
                    yield delta
                    if delta.finish_reason is not None:
                        return
        finally:
            if not seq.finished:  # the consumer went away: free the slot
                seq.aborted = True
                with self._pending_lock, contextlib.suppress(ValueError):
                    self._pending.remove(seq)
                self.host.thread.wake()

    def engine_step(self) -> bool:
        """Control thread: one forward pass of the current batch, or the prefill of a new one."""
        if self._batch is not None:
            self._batch = self._without_ended(self._batch)
        if self._batch is None:
            with self._pending_lock:
                seqs: list[_Sequence] = []
                while self._pending and len(seqs) < self._max_batch:
                    if (s := self._pending.popleft()).live:
                        seqs.append(s)
            if not seqs:
                return False
            self._batch = self._prefill_inputs(seqs)
        batch = self._batch
        try:
            with self.host.session.forward_step(self.host.weight_version), torch.inference_mode():
                out = self._model(
                    input_ids=batch.next_input,
                    attention_mask=batch.attention_mask,
                    position_ids=batch.position_ids,
                    use_cache=True,
                    logits_to_keep=0 if batch.all_logits else 1,
                    **{self._cache_kw: batch.cache},
                )
            v = self.host.weight_version
            self._forwards_by_version[v] = self._forwards_by_version.get(v, 0) + 1
            self._advance(batch, out.logits, v)
        except Exception as e:
            log.exception("engine step failed")
            self._send([(s, e) for s in batch.seqs if s.live])
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
            all_logits=any(s.request.sampling.prompt_logprobs is not None for s in seqs),
        )

    def _advance(self, batch: _Batch, logits: torch.Tensor, version: int) -> None:
        """Sample each live sequence's next token from the forward pass's `logits` [batch,
        positions, vocab], send its deltas, and set up the batch's next decode step."""
        if batch.all_logits:
            width = logits.shape[1]
            for i, s in enumerate(batch.seqs):
                k = s.request.sampling.prompt_logprobs
                if k is not None:
                    p = s.request.prompt_token_ids
                    s.prompt_logprobs = prompt_logprobs(logits[i, width - len(p) :], p, k)
            batch.all_logits = False
        results = sample_batch(logits[:, -1, :], [s.sampler for s in batch.seqs])
        outbox: list[tuple[_Sequence, _Item]] = []
        next_ids: list[int] = []
        for s, sampled in zip(batch.seqs, results, strict=True):
            if not s.live or isinstance(sampled, ValueError):  # aborted meanwhile, or failed alone
                if s.live and isinstance(sampled, ValueError):
                    outbox.append((s, sampled))
                next_ids.append(self._pad)
                continue
            # The text stop strings are matched in is the replica's: the tokenizer's `detokenize`.
            finish = s.sampler.append(sampled.token_id, self.host.tokenizer.detokenize)
            if (deltas := s.delta(sampled, version, finish)) is not None:
                outbox.append((s, deltas))
            next_ids.append(sampled.token_id)
        self._send(outbox)  # marks the sequences that ended finished
        batch.next_input = torch.tensor(next_ids, dtype=torch.long).unsqueeze(1)
        batch.attention_mask = torch.cat(
            [batch.attention_mask, torch.ones((len(batch.seqs), 1), dtype=torch.long)], dim=1
        )
        batch.position_ids = batch.position_ids[:, -1:] + 1
        self._batch = self._without_ended(batch)

    @staticmethod
    def _without_ended(batch: _Batch) -> _Batch | None:
        """`batch` without its finished and aborted sequences (None: none left), so that they
        cost no more compute and an abandoned batch ends."""
        keep = [i for i, s in enumerate(batch.seqs) if s.live]
        if len(keep) == len(batch.seqs):
            return batch
        if not keep:
            return None
        idx = torch.tensor(keep, dtype=torch.long)
        batch.cache.batch_select_indices(idx)
        batch.seqs = [batch.seqs[i] for i in keep]
        batch.next_input = batch.next_input[idx]
        batch.attention_mask = batch.attention_mask[idx]
        batch.position_ids = batch.position_ids[idx]
        return batch

    @staticmethod
    def _send(outbox: list[tuple[_Sequence, _Item]]) -> None:
        """Hand each sequence its items on its event loop: one cross-thread call per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Sequence, _Item]]] = {}
        for s, item in outbox:
            if isinstance(item, BaseException) or item[-1].finish_reason is not None:
                s.finished = True
            by_loop.setdefault(s.loop, []).append((s, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop is closed: nobody is waiting for these sequences
                for s, _ in items:
                    s.aborted = True

    # -- profiling and weights ------------------------------------------------------------------
    def profiler(self, spec: SessionSpec) -> ProfilerBackend:
        return in_process_backend(spec)

    async def abort(self, request_ids: list[str] | None) -> None:
        named = None if request_ids is None else set(request_ids)

        def abort() -> None:  # on the control thread: between two engine steps
            with self._pending_lock:
                waiting = [s for s in self._pending if named is None or s.request.request_id in named]
                for s in waiting:
                    self._pending.remove(s)
            batch = self._batch.seqs if self._batch else []
            running = [s for s in batch if named is None or s.request.request_id in named]
            # Sent now; the next step drops the running ones from the batch (and its KV cache).
            self._send([(s, s.abort_deltas()) for s in [*waiting, *running] if s.live])

        await self.host.on_thread(abort)

    async def pause(self) -> None:
        self.host.thread.admit(False)

    async def resume(self) -> None:
        self.host.thread.admit(True)

    async def read_weights(self, path: Path) -> StateDict:
        # On a thread of its own: the control thread may be finalizing the stop's recording.
        return await asyncio.wrap_future(self._reader.submit(read_state_dict, path))

    async def load_weights(self, weights: StateDict, version: int) -> None:
        def load() -> None:
            _check_state(self._model, weights)
            self.host.session.mark_weight_update(version, lambda: self._model.load_state_dict(weights, strict=True))

        await self.host.on_thread(load)

    async def receive_weights(
        self, transfer: CollectiveTransfer, first_rank: int, world_size: int, timeout_s: float
    ) -> None:
        _check_transfer(self._model, transfer)

        def receive() -> StateDict:
            store = weight_wire.connect_store(transfer.address, transfer.port, timeout_s)
            group = weight_wire.open_group(store, transfer, first_rank, world_size, timeout_s)
            # Each tensor is a view into its bucket's buffer, which the broadcast filled: no copy.
            return dict(weight_wire.receive(group, transfer, torch.device("cpu")))

        # On a thread of its own, like reading a path: the control thread keeps generating.
        self._staged = await asyncio.to_thread(receive)

    async def staged_weights(self) -> StateDict:
        if self._staged is None:
            raise WeightsError("no weights are staged: the collective transfer did not reach this replica")
        return self._staged

    async def drop_staged(self) -> None:
        self._staged = None

    async def weights_snapshot(self) -> StateDict:
        # On the control thread: no load swaps the weights halfway through the copy.
        return await self.host.on_thread(lambda: {k: v.detach().clone() for k, v in self._model.state_dict().items()})

    def pass_counts(self) -> PassCounts:
        return PassCounts(run=dict(self._forwards_by_version), recorded=self.host.session.recorded_by_version())

    def healthy(self) -> bool:
        return True

    async def close(self) -> None:
        # The control thread has stopped: fail what it will never generate.
        with self._pending_lock:
            waiting = [*self._pending, *(self._batch.seqs if self._batch else [])]
            self._pending.clear()
        self._batch = None
        self._send([(s, RuntimeError("the engine shut down")) for s in waiting if s.live])
        self._reader.shutdown(wait=False)


def _deliver(items: list[tuple[_Sequence, _Item]]) -> None:
    """On a sequence's event loop: queue its items for its consumer."""
    for s, item in items:
        s.channel.put_nowait(item)


def _check_transfer(model: LlamaForCausalLM, transfer: CollectiveTransfer) -> None:
    """The tensors on offer must be the served model's, name for name (before joining the
    group, so a mismatch costs no bytes)."""
    own = {k: weight_wire.meta_of(k, v) for k, v in model.state_dict().items()}
    offered = {t.name: t for t in transfer.tensors}
    missing = sorted(own.keys() - offered.keys())
    unexpected = sorted(offered.keys() - own.keys())
    wrong = sorted(
        f"{k} ({offered[k].dtype} {offered[k].shape}, served {own[k].dtype} {own[k].shape})"
        for k in own.keys() & offered.keys()
        if offered[k] != own[k]
    )
    if missing or unexpected or wrong:
        raise WeightsError(
            "the transfer's tensors do not fit the served model: "
            f"missing {missing[:3]}, unexpected {unexpected[:3]}, wrong dtype or shape {wrong[:3]}"
        )


def _check_state(model: LlamaForCausalLM, state: StateDict) -> None:
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    wrong = [k for k in own.keys() & state.keys() if own[k].shape != state[k].shape]
    if missing or unexpected or wrong:
        raise WeightsError(
            "weights do not fit the served model: "
            f"missing {missing[:3]}, unexpected {unexpected[:3]}, wrong shape {wrong[:3]}"
        )
