"""The collective weight-transfer protocol (serve_app/weight_wire.py, serve_app/api.py): the
bucket plan both ends share, bit-exact delivery of every dtype to several receivers over a real
gloo group, and the request's validation."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from pydantic import ValidationError

from serve_app import weight_wire
from serve_app.api import ALIGN_BYTES, DTYPE_BYTES, CollectiveTransfer, TensorMeta, UpdateWeightsRequest, plan_buckets


def _transfer(tensors: list[TensorMeta], bucket_bytes: int = 1 << 10, port: int = 1) -> CollectiveTransfer:
    return CollectiveTransfer(address="127.0.0.1", port=port, group="g1", bucket_bytes=bucket_bytes, tensors=tensors)


def test_buckets_pack_in_order_aligned_and_a_large_tensor_travels_alone():
    small = TensorMeta(name="a", dtype="float32", shape=[10])  # 40 bytes
    large = TensorMeta(name="big", dtype="float32", shape=[1000])  # 4000 bytes > one bucket
    odd = TensorMeta(name="b", dtype="int8", shape=[3])
    plan = plan_buckets(_transfer([small, odd, large, small.model_copy(update={"name": "c"})]))
    assert [b.indexes for b in plan] == [[0, 1], [2], [3]]
    assert plan[0].offsets == [0, ALIGN_BYTES] and plan[0].nbytes == ALIGN_BYTES + 3
    assert plan[1].nbytes == 4000 and plan[1].offsets == [0]
    assert all(o % ALIGN_BYTES == 0 for b in plan for o in b.offsets)


def _random(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random bits of `dtype` (NaN payloads and all), so a conversion anywhere would show."""
    size = torch.empty((), dtype=dtype).element_size()
    n = 1
    for d in shape:
        n *= d
    high = 2 if dtype == torch.bool else 256  # a bool's byte is 0 or 1
    raw = torch.randint(0, high, (n * size,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def test_every_dtype_reaches_two_receivers_bit_exact():
    gen = torch.Generator().manual_seed(0)
    state = {
        f"t_{name}": _random(getattr(torch, name), (9, 11) if i % 2 else (37,), gen)
        for i, name in enumerate(DTYPE_BYTES)
    }
    state["empty"] = torch.empty((0, 4), dtype=torch.float32)
    state["large"] = _random(torch.float32, (600,), gen)  # 2400 bytes: over one 1 KiB bucket
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    transfer = _transfer([weight_wire.meta_of(k, v) for k, v in state.items()], port=store.port)
    assert len(plan_buckets(transfer)) >= 3
    received: dict[int, dict[str, torch.Tensor]] = {}
    errors: list[BaseException] = []

    def receiver(rank: int) -> None:
        try:
            client = weight_wire.connect_store("127.0.0.1", store.port, 30)
            group = weight_wire.open_group(client, transfer.group, rank, 3, 30, "gloo")
            received[rank] = {k: v.clone() for k, v in weight_wire.receive(group, transfer, torch.device("cpu"))}
        except BaseException as e:  # noqa: BLE001 - failed in the test below
            errors.append(e)

    threads = [threading.Thread(target=receiver, args=(r,)) for r in (1, 2)]
    for thread in threads:
        thread.start()
    sent: list[tuple[int, int]] = []
    group = weight_wire.open_group(store, transfer.group, 0, 3, 30, "gloo")
    weight_wire.send(group, transfer, state, torch.device("cpu"), lambda i, n: sent.append((i, n)))
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    buckets = len(plan_buckets(transfer))
    assert sent == [(i, buckets) for i in range(buckets)]
    for rank in (1, 2):
        got = received[rank]
        assert list(got) == list(state)
        for name, t in state.items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
            assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), f"{name} differs on rank {rank}"


def test_unknown_dtype_is_refused_naming_the_known_ones():
    with pytest.raises(ValidationError, match="dtype 'complex64' cannot travel by collective; use one of float32"):
        TensorMeta(name="x", dtype="complex64", shape=[2])


def test_negative_size_is_refused():
    with pytest.raises(ValidationError, match="negative size"):
        TensorMeta(name="x", dtype="float32", shape=[2, -1])


def test_duplicate_names_are_refused():
    t = TensorMeta(name="w", dtype="float32", shape=[2])
    with pytest.raises(ValidationError, match="tensor names must be unique; twice: w"):
        _transfer([t, t])


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"source": "path"}, "source 'path' needs `path`"),
        ({"source": "collective"}, "source 'collective' needs `collective`"),
        ({"source": "external", "path": "w.safetensors"}, "`path` is only read with source 'path', not 'external'"),
        ({"path": "w.safetensors", "collective": "T"}, "`collective` is only read with source 'collective'"),
    ],
)
def test_request_takes_exactly_what_its_source_reads(body, message):
    if body.get("collective") == "T":
        body["collective"] = _transfer([TensorMeta(name="w", dtype="float32", shape=[2])]).model_dump()
    with pytest.raises(ValidationError, match=message):
        UpdateWeightsRequest(version=1, **body)


def test_request_sources_that_fit():
    assert UpdateWeightsRequest(version=1, path="w.safetensors").source == "path"
    assert UpdateWeightsRequest(version=1, source="external").path is None
    transfer = _transfer([TensorMeta(name="w", dtype="float32", shape=[2])])
    assert UpdateWeightsRequest(version=1, source="collective", collective=transfer).collective == transfer
