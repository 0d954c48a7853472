"""trace_collection: ray, without Ray: the replica's ShippingTraceStore ships a finished entry's
files in chunks, entry last, and deletes them; keeps them and names where when shipping fails;
the collector's body reassembles chunks under save_path and refuses paths outside a rollout dir.
(tests/integration/test_multi_node.py runs the real thing on a 2-node cluster.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from profiling.manifest import ManifestEntry
from serve_app import trace_collection
from serve_app.trace_collection import ShippingTraceStore, TraceCollectorLogic


class ShipToLocalCollector(ShippingTraceStore):
    """Calls the collector's body in-process instead of through Ray; records each call."""

    def __init__(self, local: Path, save_path: Path, fail_on: str | None = None):
        super().__init__(local, "app")
        self.collector = TraceCollectorLogic(str(save_path))
        self.calls: list[tuple] = []
        self.fail_on = fail_on

    def _call(self, method: str, *args: object) -> object:
        self.calls.append((method, *args))
        if method == self.fail_on:
            raise ConnectionError("collector unreachable")
        return getattr(self.collector, method)(*args)


def entry(**kw) -> ManifestEntry:
    return ManifestEntry(role="rollout", replica_id="r1", node_id="node-a", **kw)


def test_a_finished_entry_ships_its_files_in_chunks_then_the_entry_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(trace_collection, "CHUNK_BYTES", 1000)
    store = ShipToLocalCollector(tmp_path / "node", tmp_path / "save")
    store.write_entry(3, entry(exporting=True))
    assert [c[0] for c in store.calls] == ["write_entry"], "while recording, only the entry travels"
    out = store.entry_dir(3, entry())
    payload = bytes(range(256)) * 10  # 2560 bytes: three chunks
    (out / "trace.pt.trace.json.gz").write_bytes(payload)
    store.calls.clear()
    store.write_entry(3, entry(files=["rollout/r1/trace.pt.trace.json.gz"]))
    chunks = [(c[4], c[5]) for c in store.calls if c[0] == "write_chunk"]
    assert chunks == [(0, False), (1000, False), (2000, True)]
    assert store.calls[-1][0] == "write_entry", "the entry goes last: complete means the files are there"
    shipped = tmp_path / "save" / "step_3" / "rollout" / "r1"
    assert (shipped / "trace.pt.trace.json.gz").read_bytes() == payload
    assert ManifestEntry.model_validate_json((shipped / "entry.record").read_text()).exporting is False
    assert not any(p.is_file() for p in (tmp_path / "node").rglob("*")), "nothing stranded on the node"


def test_a_failed_ship_keeps_the_files_and_says_where(tmp_path):
    store = ShipToLocalCollector(tmp_path / "node", tmp_path / "save", fail_on="write_chunk")
    out = store.entry_dir(2, entry())
    out.mkdir(parents=True)
    (out / "trace.pt.trace.json.gz").write_bytes(b"x" * 10)
    with pytest.raises(OSError, match=r"kept on node node-a under .*step_2/rollout/r1"):
        store.write_entry(2, entry(files=["rollout/r1/trace.pt.trace.json.gz"]))
    assert (out / "trace.pt.trace.json.gz").exists()


def test_the_collector_writes_only_inside_a_rollout_directory(tmp_path):
    collector = TraceCollectorLogic(str(tmp_path))
    with pytest.raises(ValueError, match="outside step 1's rollout directory"):
        collector.write_chunk(1, "../../etc/x", b"no", 0, True)
    with pytest.raises(ValueError, match="outside"):
        collector.write_chunk(1, "session.json", b"no", 0, True)
    collector.write_chunk(1, "rollout/r1/t.json", b"ab", 0, False)
    assert not (tmp_path / "step_1/rollout/r1/t.json").exists(), "a file appears only once complete"
    collector.write_chunk(1, "rollout/r1/t.json", b"cd", 2, True)
    assert (tmp_path / "step_1/rollout/r1/t.json").read_bytes() == b"abcd"
