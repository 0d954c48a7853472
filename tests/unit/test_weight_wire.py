"""The collective weight-transfer protocol (serve_app/weights/collective.py, collective_schema.py, buckets.py): the
bucket plan both ends share, bit-exact delivery of every dtype to several receivers over a real
gloo group, the closed rendezvous (a store on the named interface alone, every key sealed with the
sync's secret: a second process without it can neither plant a world size nor join), and the
request's validation (its secret never echoed)."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fastapi.testclient import TestClient
from pydantic import ValidationError

from serve_app.api import UpdateWeightsRequest
from serve_app.ingress.builder import HIDDEN, create_fastapi_app
from serve_app.weights import collective as weight_wire
from serve_app.weights.buckets import plan_buckets
from serve_app.weights.collective_schema import ALIGN_BYTES, DTYPE_BYTES, CollectiveTransfer, TensorMeta

REPO_ROOT = Path(__file__).resolve().parents[2]


def _transfer(tensors: list[TensorMeta], bucket_bytes: int = 1 << 10, port: int = 1) -> CollectiveTransfer:
    return CollectiveTransfer(
        address="127.0.0.1",
        port=port,
        group="g1",
        secret=weight_wire.new_secret(),
        bucket_bytes=bucket_bytes,
        tensors=tensors,
    )


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
    store = weight_wire.host_store("127.0.0.1", 0, 30)
    transfer = _transfer([weight_wire.meta_of(k, v) for k, v in state.items()], port=store.port)
    weight_wire.host_sync(store, transfer)
    assert len(plan_buckets(transfer)) >= 3
    received: dict[int, dict[str, torch.Tensor]] = {}
    errors: list[BaseException] = []

    def receiver(rank: int) -> None:
        try:
            client = weight_wire.connect_store("127.0.0.1", store.port, 30)
            group = weight_wire.open_group(client, transfer, rank, 3, 30)
            received[rank] = {k: v.clone() for k, v in weight_wire.receive(group, transfer, torch.device("cpu"))}
        except BaseException as e:  # noqa: BLE001 - failed in the test below
            errors.append(e)

    threads = [threading.Thread(target=receiver, args=(r,)) for r in (1, 2)]
    for thread in threads:
        thread.start()
    sent: list[tuple[int, int]] = []
    group = weight_wire.open_group(store, transfer, 0, 3, 30)
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


def test_no_member_drops_the_group_before_every_member_is_done():
    """A member done first waits in the store for the slowest, so it never closes its connections
    under one still setting up its own (gloo fails that one's join with "Connection closed by
    peer", seen under load); a member that never finishes fails the wait after the timeout."""
    state = {"a": torch.arange(300, dtype=torch.float32), "b": torch.ones(5)}
    done: dict[str, BaseException | None] = {}

    def member(name: str, go: Callable[[], object]) -> threading.Thread:
        def run() -> None:
            try:
                go()
                done[name] = None
            except BaseException as e:  # noqa: BLE001 - failed in the test below
                done[name] = e

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    def start(timeout_s: float) -> tuple[threading.Thread, threading.Thread, Iterator[tuple[str, torch.Tensor]]]:
        """A sync of `state` to two members: the sender and a fast member in threads, the slow
        member's generator for the test to step through."""
        store, transfer = _publisher(state)

        def receive(rank: int) -> Iterator[tuple[str, torch.Tensor]]:
            client = weight_wire.connect_store("127.0.0.1", store.port, timeout_s)
            group = weight_wire.open_group(client, transfer, rank, 3, timeout_s)
            return weight_wire.receive(group, transfer, torch.device("cpu"))

        def send() -> None:
            group = weight_wire.open_group(store, transfer, 0, 3, timeout_s)
            weight_wire.send(group, transfer, state, torch.device("cpu"))

        return member("sender", send), member("fast", lambda: dict(receive(1))), receive(2)

    sender, fast, slow = start(30)
    got = [next(slow) for _ in state]  # every tensor is here; the generator has not finished
    assert [name for name, _ in got] == list(state)
    time.sleep(0.5)
    assert sender.is_alive() and fast.is_alive(), f"a member dropped the group before the slowest was done: {done}"
    with pytest.raises(StopIteration):
        next(slow)
    sender.join(30)
    fast.join(30)
    assert done == {"sender": None, "fast": None}

    sender, fast, slow = start(2)
    [next(slow) for _ in state]  # and never finishes
    sender.join(30)
    fast.join(30)
    for name in ("sender", "fast"):
        assert isinstance(done[name], TimeoutError), done
        assert "not every member of the sync's group finished within 2s" in str(done[name])


# -- the closed rendezvous -----------------------------------------------------------------------
INTRUDER = r"""
import datetime, json, sys
import torch.distributed as dist
from serve_app.weights import collective as weight_wire
from serve_app.weights.collective_schema import CollectiveTransfer

known = CollectiveTransfer.model_validate_json(sys.argv[1])  # all of the sync but its secret
client = weight_wire.connect_store(known.address, known.port, 10)
outcome = {"listed": client.list_keys()}
# A world size planted where the group's name says, in the clear and sealed with a secret of its own.
client.set(f"{known.group}/world_size", "7")
weight_wire.SealedStore(client, known.secret).set(f"{known.group}/world_size", "7")
print("planted", flush=True)
try:
    weight_wire.open_group(client, known, 1, 2, 3)
    outcome["sealed_join"] = "joined"
except Exception as e:
    outcome["sealed_join"] = f"{type(e).__name__}: {e}"
try:  # past the seal: the group's prefix, in the clear, as rank 1
    dist.ProcessGroupGloo(dist.PrefixStore(f"{known.group}/pg/", client), 1, 2, datetime.timedelta(seconds=3))
    outcome["plain_join"] = "joined"
except Exception as e:
    outcome["plain_join"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
print(json.dumps(outcome), flush=True)
"""


def _publisher(state: dict[str, torch.Tensor]) -> tuple[dist.TCPStore, CollectiveTransfer]:
    store = weight_wire.host_store("127.0.0.1", 0, 30)
    transfer = _transfer([weight_wire.meta_of(k, v) for k, v in state.items()], port=store.port)
    weight_wire.host_sync(store, transfer)
    return store, transfer


def test_a_process_without_the_secret_can_neither_plant_a_world_size_nor_join_and_the_members_complete():
    """A second process knows the store's address and port, the group and the tensors (everything
    the request carries but the secret): the world size it plants is not the one the publisher
    reads, it cannot join, sealed or in the clear, and the real sync completes bit-exact."""
    gen = torch.Generator().manual_seed(1)
    state = {"w": _random(torch.float32, (300,), gen), "b": _random(torch.bfloat16, (7, 3), gen)}
    store, transfer = _publisher(state)
    known = transfer.model_copy(update={"secret": weight_wire.new_secret()})
    intruder = subprocess.Popen(
        [sys.executable, "-c", INTRUDER, known.model_dump_json()],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert intruder.stdout is not None and intruder.stdout.readline().strip() == "planted", intruder.stderr
        # The controller's part: the world size, sealed with the sync's secret.
        weight_wire.announce(weight_wire.connect_store("127.0.0.1", store.port, 10), transfer, 2, 10)
        assert weight_wire.read_world_size(store, transfer) == 2, "the publisher read a planted world size"
        received: dict[str, torch.Tensor] = {}
        errors: list[BaseException] = []

        def receiver() -> None:
            try:
                group = weight_wire.open_group(
                    weight_wire.connect_store("127.0.0.1", store.port, 30), transfer, 1, 2, 30
                )
                received.update({k: v.clone() for k, v in weight_wire.receive(group, transfer, torch.device("cpu"))})
            except BaseException as e:  # noqa: BLE001 - failed in the test below
                errors.append(e)

        thread = threading.Thread(target=receiver)
        thread.start()
        weight_wire.send(weight_wire.open_group(store, transfer, 0, 2, 30), transfer, state, torch.device("cpu"))
        thread.join(60)
        assert not errors, errors
        assert all(torch.equal(received[k].view(torch.uint8), t.view(torch.uint8)) for k, t in state.items())
        out, err = intruder.communicate(timeout=60)
    finally:
        intruder.kill()
    outcome = json.loads(out.strip().splitlines()[-1])
    assert outcome["sealed_join"].startswith("PermissionError: ") and "another secret" in outcome["sealed_join"], (
        outcome,
        err,
    )
    assert outcome["plain_join"] != "joined" and "timeout" in outcome["plain_join"].lower(), (outcome, err)
    assert transfer.secret not in json.dumps(outcome), "the secret was readable in the store"
    assert all(k == f"{transfer.group}/{weight_wire.CHECK_KEY}" for k in outcome["listed"]), outcome["listed"]


def test_in_the_clear_a_planted_world_size_is_what_the_publisher_reads():
    """The check above fails where keys are in the clear: a planted world size is what is read."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = weight_wire.connect_store("127.0.0.1", store.port, 10)
    client.set(f"g1/{weight_wire.WORLD_SIZE_KEY}", "7")
    assert int(store.get(f"g1/{weight_wire.WORLD_SIZE_KEY}")) == 7


def test_a_member_with_another_secret_is_refused_at_once_naming_it():
    store, transfer = _publisher({"w": torch.zeros(4)})
    wrong = transfer.model_copy(update={"secret": weight_wire.new_secret()})
    client = weight_wire.connect_store("127.0.0.1", store.port, 10)
    t0 = time.monotonic()
    with pytest.raises(PermissionError, match=r"sealed group g1 with another secret than this request's"):
        weight_wire.open_group(client, wrong, 1, 2, 30)
    with pytest.raises(PermissionError, match="another secret"):
        weight_wire.announce(client, wrong, 2, 30)
    assert time.monotonic() - t0 < 10, "a wrong secret must fail at once, not after the timeout"
    assert not weight_wire.SealedStore(store, transfer.secret).check([f"g1/{weight_wire.WORLD_SIZE_KEY}"])
    weight_wire.member_store(client, transfer, 30)  # the right one passes


def test_a_check_key_overwritten_by_another_process_refuses_every_member():
    store, transfer = _publisher({"w": torch.zeros(4)})
    client = weight_wire.connect_store("127.0.0.1", store.port, 10)
    client.set(f"g1/{weight_wire.CHECK_KEY}", "planted")
    with pytest.raises(PermissionError, match="another process overwrote the group's check key"):
        weight_wire.member_store(client, transfer, 30)


def test_a_world_size_overwritten_by_another_process_is_refused_never_read():
    """A process without the secret can list the keys and overwrite the one it finds: the
    publisher then refuses the value instead of using it."""
    store, transfer = _publisher({"w": torch.zeros(4)})
    weight_wire.announce(weight_wire.connect_store("127.0.0.1", store.port, 10), transfer, 3, 10)
    assert weight_wire.read_world_size(store, transfer) == 3
    intruder = weight_wire.connect_store("127.0.0.1", store.port, 10)
    for key in intruder.list_keys():
        if key != f"g1/{weight_wire.CHECK_KEY}":
            intruder.set(key, weight_wire.SealedStore(intruder, weight_wire.new_secret()).seal(key, b"7"))
    with pytest.raises(weight_wire.ForeignValue, match="not sealed with this secret: another process wrote it"):
        weight_wire.read_world_size(store, transfer)


class _TamperedApp:
    """The app's side of a sync, in this process, as the trainer's client reaches it: it writes the
    world size, then another process overwrites every key it lists; it never answers."""

    def __init__(self) -> None:
        self.requests: list[UpdateWeightsRequest] = []

    async def publish_weights(self, request: UpdateWeightsRequest) -> None:
        self.requests.append(request)
        transfer = request.collective
        assert transfer is not None
        client = weight_wire.connect_store(transfer.address, transfer.port, 10)
        weight_wire.announce(client, transfer, 2, 10)
        for key in client.list_keys():
            if not key.endswith(f"/{weight_wire.CHECK_KEY}"):
                client.set(key, "2")
        await asyncio.sleep(60)


async def test_the_publisher_refuses_a_world_size_another_process_overwrote_and_forms_no_group():
    from trainer.client import RolloutError
    from trainer.collective import CollectiveWeights

    app = _TamperedApp()
    publisher = CollectiveWeights(app, timeout_s=10)  # type: ignore[arg-type]
    with pytest.raises(RolloutError, match="no group formed: another process overwrote the group's world size"):
        await publisher.update_weights(1, {"w": torch.zeros(2)})
    (request,) = app.requests
    assert request.collective is not None and len(request.collective.secret) == 64
    second = CollectiveWeights(app, timeout_s=10)  # type: ignore[arg-type]
    with pytest.raises(RolloutError):
        await second.update_weights(2, {"w": torch.zeros(2)})
    assert app.requests[1].collective.secret != request.collective.secret, "a secret is the sync's alone"


def test_a_group_the_publisher_never_opened_times_out_naming_it():
    store = weight_wire.host_store("127.0.0.1", 0, 30)
    transfer = _transfer([TensorMeta(name="w", dtype="float32", shape=[2])], port=store.port)
    with pytest.raises(TimeoutError, match=r"has no group g1 \(timed out after 1s\)"):
        weight_wire.open_group(weight_wire.connect_store("127.0.0.1", store.port, 10), transfer, 1, 2, 1)


def test_sealed_keys_hide_their_names_and_values_and_count_across_members():
    store = weight_wire.host_store("127.0.0.1", 0, 30)
    secret = weight_wire.new_secret()
    members = [
        weight_wire.SealedStore(weight_wire.connect_store("127.0.0.1", store.port, 10), secret) for _ in range(2)
    ]
    members[0].set("g1/pg/rank_0", b"10.0.0.7:4711")
    assert members[1].get("g1/pg/rank_0") == b"10.0.0.7:4711"
    counted: list[int] = []
    threads = [
        threading.Thread(target=lambda m=m: counted.extend(m.add("g1/n", 1) for _ in range(20))) for m in members
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(counted) == list(range(1, 41)), "each add must see every other one"
    assert members[0].add("g1/n", 0) == 40 and members[1].get("g1/n") == b"40"
    raw = weight_wire.connect_store("127.0.0.1", store.port, 10)
    for key in raw.list_keys():
        assert re.fullmatch(r"[0-9a-f]{64}", key), key
        assert b"10.0.0.7" not in raw.get(key) and secret.encode() not in raw.get(key)


def _reachable(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=3):
            return True
    except OSError:
        return False


def test_the_store_listens_on_the_interface_it_is_given_alone(non_loopback_address):
    store = weight_wire.host_store("127.0.0.1", 0, 30)
    assert _reachable("127.0.0.1", store.port)
    assert not _reachable(non_loopback_address, store.port), f"reachable on {non_loopback_address}"


def test_a_plain_tcp_store_given_loopback_listens_on_every_interface(non_loopback_address):
    """Why the store binds its own socket: the check above fails on TCPStore's own server."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert _reachable(non_loopback_address, store.port)


def test_an_address_that_is_not_this_hosts_is_refused_naming_the_fix():
    with pytest.raises(OSError, match=r"cannot listen on 192\.0\.2\.254:0 .*name an address of this host"):
        weight_wire.host_store("192.0.2.254", 0, 30)


def test_the_secret_is_never_echoed_in_a_422_nor_in_a_repr():
    app = create_fastapi_app()

    @app.post("/w")
    async def update(body: UpdateWeightsRequest) -> None: ...

    transfer = _transfer([TensorMeta(name="w", dtype="float32", shape=[2])])
    body = {"version": 1, "source": "collective", "path": "w.safetensors", "collective": transfer.model_dump()}
    bad_secret = "A" * 40  # not hex: the error's input is the secret itself
    malformed = {**body, "path": None, "collective": {**transfer.model_dump(), "secret": bad_secret}}
    with TestClient(app) as client:
        for sent, secret in ((body, transfer.secret), (malformed, bad_secret)):
            answer = client.post("/w", json={k: v for k, v in sent.items() if v is not None})
            assert answer.status_code == 422, answer.text
            assert secret not in answer.text and HIDDEN in answer.text, answer.text
    request = UpdateWeightsRequest(version=1, source="collective", collective=transfer)
    assert transfer.secret not in repr(request) and transfer.secret not in str(request)


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
