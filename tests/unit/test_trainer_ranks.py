"""Several trainer ranks: rank selection in the trainer config, the trainer record that names a
rank that died, the sync's cost split, the clock composed through the driving rank, and the ranks'
group: formed on the launcher's store (loopback alone, every key sealed with the launch's secret),
sharing mini-batches and notes as JSON, never a pickle (two real rank processes)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from profiling.manifest import ClockOffset, ManifestEntry, SessionRecord, StepManifest, SyncCost, TrainerRecord
from profiling.store import TRAINER_RECORD, TraceStore
from serve_app.weights.collective import connect_store
from trainer.config import ConfigError, load_config
from trainer.distributed import compose, host_rendezvous

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_rank_zero_records_by_default():
    cfg = load_config(None, ["trainer.world_size=2"])
    assert cfg.profiler.selected(2) == [0]


def test_all_ranks_selects_every_rank():
    cfg = load_config(None, ["trainer.world_size=2", "profiler.all_ranks=true"])
    assert cfg.profiler.selected(2) == [0, 1]


def test_ranks_name_the_ranks_that_record():
    cfg = load_config(None, ["trainer.world_size=2", "profiler.ranks=[1]"])
    assert cfg.profiler.selected(2) == [1]
    assert "ranks" not in cfg.profiler.window_options().model_dump(), "a recording's options carry no selection"


def test_a_rank_beyond_the_world_is_refused_naming_both_keys():
    with pytest.raises(ConfigError, match=r"profiler.ranks \[2\].*trainer.world_size is 2 \(ranks 0..1\)"):
        load_config(None, ["trainer.world_size=2", "profiler.ranks=[2]"])


def test_rank_zero_of_a_single_process_is_the_default_and_rank_one_is_not():
    with pytest.raises(ConfigError, match=re.escape("trainer.world_size is 1")):
        load_config(None, ["profiler.ranks=[1]"])


@pytest.mark.parametrize("ranks", ["[-1]", "[0, 0]"])
def test_ranks_must_be_distinct_and_not_negative(ranks):
    with pytest.raises(ConfigError, match="distinct ranks"):
        load_config(None, [f"profiler.ranks={ranks}"])


def test_all_ranks_with_explicit_ranks_is_a_contradiction():
    with pytest.raises(ConfigError, match="remove one of them"):
        load_config(None, ["profiler.all_ranks=true", "profiler.ranks=[0]"])


def test_every_rank_needs_part_of_a_mini_batch():
    with pytest.raises(ConfigError, match=re.escape("mini_batch_size 2 is below trainer.world_size 4")):
        load_config(None, ["trainer.world_size=4", "trainer.mini_batch_size=2"])


def test_the_trainer_config_keeps_its_selection_through_a_round_trip():
    """The launcher hands each rank the config as JSON: the selection must survive it."""
    from trainer.config import TrainerConfig

    cfg = load_config("config/trainer.fsdp.yaml")
    again = TrainerConfig.model_validate_json(cfg.model_dump_json(exclude_unset=True))
    assert again == cfg and again.profiler.selected(2) == [0, 1]


# -- the manifest of a step with a dead rank ---------------------------------------------------
def _session() -> SessionRecord:
    return SessionRecord(step=1, steps=[1], tool="torch", options={}, started_at=1.0, stopped_at=2.0)


def _ok(rank: int) -> ManifestEntry:
    return ManifestEntry(role="trainer", rank=rank, files=[f"trainer/rank_{rank}/t.json.gz"])


def test_a_rank_that_died_mid_step_makes_the_step_partial_naming_it():
    started = ManifestEntry(role="trainer", rank=1, exporting=True)
    record = TrainerRecord(ranks=[0, 1], failures={1: "trainer rank 1 was killed by SIGKILL"})
    m = StepManifest.assemble(1, _session(), [_ok(0), started], record)
    assert m.status == "partial"
    dead = next(e for e in m.entries if e.key == "trainer/rank_1")
    assert dead.status == "error" and not dead.exporting and "SIGKILL" in (dead.error or "")


def test_a_dead_rank_that_never_wrote_an_entry_is_still_named():
    record = TrainerRecord(ranks=[0, 1], failures={1: "trainer rank 1 exited with status 1"})
    m = StepManifest.assemble(1, _session(), [_ok(0)], record)
    assert m.status == "partial" and [e.key for e in m.entries] == ["trainer/rank_0", "trainer/rank_1"]


def test_a_rank_that_died_after_its_export_keeps_its_trace():
    record = TrainerRecord(ranks=[0, 1], failures={1: "trainer rank 1 was killed by SIGKILL"})
    m = StepManifest.assemble(1, _session(), [_ok(0), _ok(1)], record)
    assert m.status == "complete"


def test_a_selected_rank_not_yet_written_is_awaited():
    m = StepManifest.assemble(1, _session(), [_ok(0)], TrainerRecord(ranks=[0, 1]))
    assert m.status == "exporting", "without rank 1's trace the step must not look complete"


def test_the_store_reads_the_record_written_by_two_writers(tmp_path):
    store = TraceStore(tmp_path)
    store.write_session(1, _session())
    store.write_entry(1, _ok(0))
    store.update_trainer_record(1, lambda r: TrainerRecord(ranks=[0, 1], world_size=2, driver_rank=0))
    assert (tmp_path / "step_1" / TRAINER_RECORD).is_file()
    assert store.read_manifest(1).status == "exporting"
    m = store.update_trainer_record(
        1, lambda r: r.model_copy(update={"failures": {1: "trainer rank 1 was killed by SIGKILL"}})
    )
    assert m.status == "partial" and store.read_trainer_record(1).ranks == [0, 1]
    assert store.read_manifest(1).status == "partial"


# -- the sync's cost and the composed clock ----------------------------------------------------
def test_the_sync_cost_splits_the_transfer_and_keeps_the_critical_path():
    cost = SyncCost(
        stop_s=0.1, update_s=0.5, start_s=0.1, transfer="collective", publish_s=2.0, transfer_s=0.3, load_s=0.1
    )
    assert cost.total_s == pytest.approx(0.7), "publishing is off the critical path; the transfer is within update_s"
    assert SyncCost.model_validate_json(cost.model_dump_json()) == cost


def test_a_rank_clock_composes_through_the_driving_rank():
    to_driver = ClockOffset(offset_ns=-500, bound_ns=20, samples=5)
    driver_to_app = ClockOffset(offset_ns=1_000, bound_ns=300, samples=5)
    assert compose(to_driver, driver_to_app) == ClockOffset(offset_ns=500, bound_ns=320, samples=5)
    assert compose(to_driver, None) is None


# -- the ranks' group: a sealed rendezvous on loopback, JSON between the ranks ------------------
RANK = r"""
import asyncio, json, pickle, sys
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from profiling.manifest import ClockOffset
from trainer.distributed import GlooRankLink, Ranks, Rendezvous, init_group, share_from_driver
from trainer.loop import MiniBatch
from trainer.policy import Sample
from trainer.profiled_sync import DriverNote

def no_pickle(*args, **kwargs):
    raise AssertionError("a pickle crossed between the ranks")

c10d._pickler = c10d._unpickler = no_pickle  # what torch's object collectives pickle with
rendezvous, rank = Rendezvous.model_validate_json(sys.argv[1]), int(sys.argv[2])
ranks = Ranks(rank=rank, world_size=2, selected=[0])
store = init_group(ranks, rendezvous, 30)
sample = Sample(prompt_ids=[1, 2], completion_ids=[3], logprobs=[-0.25], weight_version=4, reward=1.0)
batch = MiniBatch(samples=[sample], dropped=1, taken=2)
out = {"batch": share_from_driver(batch if ranks.drives else None, MiniBatch, ranks).model_dump(mode="json")}
note = DriverNote(clock_offset=ClockOffset(offset_ns=5, bound_ns=2, samples=3))
got, _ = asyncio.run(GlooRankLink(ranks).from_driver(note if ranks.drives else None))
out["note"] = got.model_dump(mode="json")
if ranks.drives:  # a driving rank that shares its mini-batch pickled, in the same frame
    data = pickle.dumps(batch)
    dist.broadcast(torch.tensor([len(data)]), src=0)
    dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0)
    try:  # and the check's own proof: torch's object collective pickles, so it fails here
        dist.broadcast_object_list([batch], src=0)
    except AssertionError as e:
        out["object_list"] = str(e)
else:
    try:
        share_from_driver(None, MiniBatch, ranks)
    except ValueError as e:
        out["refused"] = str(e)
print(json.dumps(out), flush=True)
dist.destroy_process_group()
"""


def test_two_ranks_share_json_never_a_pickle_on_a_sealed_rendezvous():
    """Both ranks run with torch's pickler replaced by a failure: the mini-batch and the driving
    rank's note still arrive (the old broadcast_object_list could not), a pickle in their place is
    refused, and the launcher's store holds no key or value a process without the secret can read."""
    store, rendezvous = host_rendezvous(30)
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, rendezvous.model_dump_json(), str(r)],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = []
    try:
        for p in ranks:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-4000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in ranks:
            p.kill()
    driver, other = outs
    assert other["batch"] == driver["batch"] and other["batch"]["samples"][0]["logprobs"] == [-0.25]
    assert other["note"] == driver["note"] and other["note"]["clock_offset"]["offset_ns"] == 5
    assert "not a MiniBatch's JSON (Invalid JSON" in other["refused"], other
    assert driver["object_list"] == "a pickle crossed between the ranks", "the no-pickle check must bite"
    raw = connect_store("127.0.0.1", rendezvous.port, 10)
    keys = raw.list_keys()
    assert keys and all(re.fullmatch(r"[0-9a-f]{64}", k) for k in keys), keys
    assert not any(rendezvous.secret.encode() in raw.get(k) for k in keys)
    del store


def test_the_ranks_rendezvous_listens_on_loopback_alone(non_loopback_address):
    store, rendezvous = host_rendezvous(30)
    assert rendezvous.address == "127.0.0.1" and rendezvous.secret not in repr(rendezvous)
    with socket.create_connection(("127.0.0.1", rendezvous.port), timeout=3):
        pass
    with pytest.raises(OSError):
        socket.create_connection((non_loopback_address, rendezvous.port), timeout=3).close()
    del store
