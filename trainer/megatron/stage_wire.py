"""A pipeline stage's gathered tensors sent to global rank 0 (trainer/megatron/policy.py's merge):
their names, shapes and dtypes as JSON of a pydantic model, then each tensor, over the trainer's
process group; data, never a pickle."""

from __future__ import annotations

import torch
import torch.distributed as dist
from pydantic import BaseModel

DTYPES = {str(t): t for t in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


class TensorHeader(BaseModel):
    name: str
    shape: list[int]
    dtype: str


class StageHeader(BaseModel):
    tensors: list[TensorHeader]


def _send_bytes(data: bytes, dst: int) -> None:
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=dst)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=dst)


def _recv_bytes(src: int) -> bytes:
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src=src)
    buf = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(buf, src=src)
    return buf.numpy().tobytes()


def send_stage(tensors: dict[str, torch.Tensor], dst: int) -> None:
    """Send `tensors` to rank `dst`, which calls `receive_stage` with this rank."""
    header = StageHeader(
        tensors=[TensorHeader(name=k, shape=list(v.shape), dtype=str(v.dtype)) for k, v in tensors.items()]
    )
    _send_bytes(header.model_dump_json().encode(), dst)
    for v in tensors.values():
        dist.send(v.contiguous(), dst=dst)


def receive_stage(src: int) -> dict[str, torch.Tensor]:
    """What rank `src`'s `send_stage` sends here."""
    header = StageHeader.model_validate_json(_recv_bytes(src))
    out = {}
    for t in header.tensors:
        if t.dtype not in DTYPES:
            raise ValueError(f"rank {src} sent {t.name} as {t.dtype}, not one of {', '.join(DTYPES)}")
        out[t.name] = torch.empty(t.shape, dtype=DTYPES[t.dtype])
        dist.recv(out[t.name], src=src)
    return out
