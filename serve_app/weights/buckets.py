"""The bucket plan of a sync by collective: how the publisher and every receiver lay the tensors
out in the buffers they broadcast, computed alike at both ends from the transfer alone."""

from __future__ import annotations

from profiling.config import StrictModel
from serve_app.weights.collective_schema import ALIGN_BYTES, CollectiveTransfer


class Bucket(StrictModel):
    """One broadcast: tensors (indexes into `tensors`) at their byte offsets in one buffer."""

    indexes: list[int]
    offsets: list[int]
    nbytes: int


def plan_buckets(transfer: CollectiveTransfer) -> list[Bucket]:
    """The buckets both ends use: tensors in order, packed until the next would pass
    `bucket_bytes` (a tensor larger than that travels alone), each aligned to ALIGN_BYTES."""
    buckets: list[Bucket] = []
    current = Bucket(indexes=[], offsets=[], nbytes=0)
    for i, t in enumerate(transfer.tensors):
        start = -(-current.nbytes // ALIGN_BYTES) * ALIGN_BYTES
        if current.indexes and start + t.nbytes > transfer.bucket_bytes:
            buckets.append(current)
            current, start = Bucket(indexes=[], offsets=[], nbytes=0), 0
        current.indexes.append(i)
        current.offsets.append(start)
        current.nbytes = start + t.nbytes
    buckets.append(current)
    return buckets
