"""The wire schema of a sync by collective (docs/design.md#weights-by-collective): what the
`collective` part of a `/weights/update` says, as pydantic models. Pure pydantic, like
serve_app/api.py, which embeds `CollectiveTransfer` in its request."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from profiling.config import SafeName, StrictModel

WORLD_SIZE_KEY = "world_size"
"""Store key (under the group's prefix, sealed with the sync's secret) of the group's world size,
written by the app."""
ALIGN_BYTES = 64
"""Each tensor starts at a multiple of this in its bucket, so its bytes can be viewed as its dtype."""

DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8, "bool": 1,
}  # fmt: skip
"""The dtypes a tensor may travel as (torch's names without `torch.`), and their sizes."""


class TensorMeta(StrictModel):
    """One tensor of the checkpoint, as both ends lay it out in the buckets."""

    name: str = Field(min_length=1)
    dtype: str = Field(description="torch dtype name without 'torch.', e.g. float32, bfloat16.")
    shape: list[int]

    @field_validator("dtype")
    @classmethod
    def _known(cls, name: str) -> str:
        if name not in DTYPE_BYTES:
            raise ValueError(f"dtype {name!r} cannot travel by collective; use one of {', '.join(DTYPE_BYTES)}")
        return name

    @field_validator("shape")
    @classmethod
    def _sizes(cls, shape: list[int]) -> list[int]:
        if any(d < 0 for d in shape):
            raise ValueError(f"shape {shape} has a negative size")
        return shape

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


class CollectiveTransfer(StrictModel):
    """The `collective` part of a `/weights/update` with `source: collective`: where the
    publisher's store listens, the sync's group and its secret, and the tensors in bucket order."""

    address: str = Field(min_length=1, description="Host of the publisher's TCPStore, reachable from every replica.")
    port: int = Field(ge=1, le=65535, description="Port of the publisher's TCPStore.")
    group: SafeName = Field(description="Unique per sync: the store prefix the group is formed under.")
    secret: str = Field(
        min_length=32,
        max_length=128,
        pattern=r"^[0-9a-f]+$",
        repr=False,
        description="Fresh per sync, hex: every store key of the group is sealed with it, so only a process "
        "that presents it can join. Never logged, echoed or recorded.",
    )
    backend: Literal["gloo", "nccl"] = Field("gloo", description="gloo on CPU; nccl between GPUs.")
    bucket_bytes: int = Field(64 << 20, ge=1 << 10, le=1 << 34, description="Most bytes broadcast at once.")
    tensors: list[TensorMeta] = Field(min_length=1, description="Every tensor of the checkpoint, in bucket order.")

    @field_validator("tensors")
    @classmethod
    def _unique(cls, tensors: list[TensorMeta]) -> list[TensorMeta]:
        seen: set[str] = set()
        twice = sorted({t.name for t in tensors if t.name in seen or seen.add(t.name)})  # type: ignore[func-returns-value]
        if twice:
            raise ValueError(f"tensor names must be unique; twice: {', '.join(twice[:3])}")
        return tensors

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)
