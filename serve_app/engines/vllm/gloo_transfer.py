"""`rollout_gloo`: a vLLM weight-transfer engine over gloo, for vLLM on CPU, where none of vLLM's
own backends runs (nccl, ipc and the others need CUDA): docs/engines.md#vllm-weight-transfer-routes.

It is vLLM's dense NCCL engine (`vllm/distributed/weight_transfer/nccl_engine.py`) with gloo as
the wire (serve_app/weights/plain_group.py): the same init fields (`master_address`,
`master_port`, `rank_offset`, `world_size`), the same update fields (`names`, `dtype_names`,
`shapes`; one broadcast per tensor, unpacked), the same layerwise reload between
`start_weight_update` and `finish_weight_update`. So a trainer written against vLLM's
weight-transfer routes runs on a CPU machine unchanged but for the backend's name, and the
same calls reach `nccl` on GPUs.

The replica's worker extension registers it with vLLM's factory when vLLM imports the extension
in each worker, before the worker builds its weight-transfer engine.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from serve_app.engines.vllm.options import CPU_TRANSFER_BACKEND as BACKEND
from serve_app.weights.plain_group import PlainGroup, receive_tensor

DEFAULT_TIMEOUT_S = 300.0


@dataclass(kw_only=True)
class GlooInitInfo(WeightTransferInitInfo):
    """vLLM's NCCL init fields over gloo (`nccl_unique_id_b64` has no gloo meaning)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S
    """How long the rendezvous and each broadcast may wait for the other members."""
    packed: bool = False

    def __post_init__(self) -> None:
        if self.packed:
            raise ValueError(
                f"backend {BACKEND} sends each tensor on its own (vLLM's unpacked broadcast): send packed: false"
            )


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """vLLM's NCCL update fields: one entry per tensor, broadcast in this order."""

    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes must be as long as each other: got {len(self.names)}, "
                f"{len(self.dtype_names)} and {len(self.shapes)}"
            )


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receive dense checkpoint-format weights from the trainer (rank 0) by gloo broadcast and
    load them through vLLM's layerwise reload, as vLLM's NCCL engine does."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._group: PlainGroup | None = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        parallel = self.parallel_config
        worker_rank = parallel.data_parallel_index * parallel.world_size + parallel.rank
        if self._group is not None:
            self._group.close()
        self._group = PlainGroup(
            init_info.master_address,
            init_info.master_port,
            init_info.rank_offset + worker_rank,
            init_info.world_size,
            init_info.timeout_s,
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self._group is None:
            raise RuntimeError(f"{BACKEND} weight transfer not initialized: call /init_weight_transfer_engine first")
        model: Any = self.model  # vLLM's model classes, each with its own load_weights
        for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes, strict=True):
            model.load_weights([(name, receive_tensor(self._group, dtype_name, shape).to(self.device))])

    def shutdown(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None


def register() -> None:
    """Make `backend: rollout_gloo` known to vLLM's factory in this process (again: a no-op)."""
    with contextlib.suppress(ValueError):  # the factory's "already registered"
        WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
