"""Clocks across machines, proven with shifted clocks (docs/analysis.md#how-clocks-are-aligned).

One replica of a 2-replica app runs 2.5 s ahead and the trainer rank 1.3 s behind (Debian's
libfaketime preloaded into those processes); the controller's clock is the reference. After
three profiled steps with real generation, each process's measured offset must be within its
reported bound of the true shift, and the merged timelines must put every replica forward step
of step k inside the window the trainer's start(k) and stop(k) calls bound (allowing the
reported bounds), with stop, update_weights and start in order. The same check with the
cross-process offsets taken out must fail: it is what the exchange corrects.

Every replica process gets the library (Serve gives all replicas of a deployment one
environment); a `sitecustomize` on the replicas' PYTHONPATH lets the first replica process to
start claim the shift, by setting `FAKETIME`, which libfaketime re-reads at every call
(`FAKETIME_NO_CACHE=1`); the other replica keeps `+0`, the true time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from integ_util import write_perturbed_weights
from support.traces import read_trace

from profiling.analysis.merge import merge_step
from profiling.markers import parse_forward_step
from profiling.store import TraceStore

pytestmark = pytest.mark.integration

LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
REPLICA_SHIFT_NS = 2_500_000_000
TRAINER_SHIFT_NS = -1_300_000_000
STEPS = [1, 2, 3]
TRAINER = Path(__file__).with_name("skewed_trainer.py")
SITECUSTOMIZE = """\
import os
import select
import time

# libfaketime 0.9.10 with FAKETIME_DONT_FAKE_MONOTONIC=1 answers EINVAL to Python's time.sleep
# (clock_nanosleep on an absolute monotonic deadline); without that setting it hangs timed lock
# waits instead. So monotonic clocks stay true, and sleeps go through select, which works.
time.sleep = lambda seconds: select.select([], [], [], seconds) and None
claim = os.environ.get("CLOCK_SKEW_CLAIM")
if claim:
    try:
        fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        pass
    else:
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        os.environ["FAKETIME"] = os.environ["CLOCK_SKEW_SHIFT"]
"""


def faketime_env(shift_s: str) -> dict[str, str]:
    """libfaketime preloaded with `shift_s`; monotonic clocks left alone (durations stay true)."""
    return {
        "LD_PRELOAD": str(LIBFAKETIME),
        "FAKETIME": shift_s,
        "FAKETIME_NO_CACHE": "1",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }


@pytest.fixture
def skewed_app(ray_cluster, model_dir, tmp_path):
    if not LIBFAKETIME.is_file():
        pytest.fail(f"{LIBFAKETIME} is missing: install Debian's faketime (apt-get install faketime; .ci/run does)")
    from support.apps import deployed

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    claim = tmp_path / "skewed-replica-pid"
    env = {
        **faketime_env("+0"),
        "PYTHONPATH": str(site),
        "CLOCK_SKEW_CLAIM": str(claim),
        "CLOCK_SKEW_SHIFT": f"{REPLICA_SHIFT_NS / 1e9:+}s",
    }
    with deployed(ray_cluster, model_dir, tmp_path, "clockskew", replica_env=env, merge_on_complete=False) as app:
        yield app, int(claim.read_text()), site


def run_skewed_trainer(app, weights: Path, site: Path) -> None:
    env = {**os.environ, **faketime_env(f"{TRAINER_SHIFT_NS / 1e9:+}s"), "PYTHONPATH": str(site)}
    run = subprocess.run(
        [sys.executable, str(TRAINER), app.base_url, str(app.save_path), str(weights)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, f"the skewed trainer failed:\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"


def settled_manifest(save_path: Path, step: int, timeout_s: float = 60.0) -> dict:
    """The step's manifest once complete, with the controller's offsets for both replicas."""
    deadline = time.monotonic() + timeout_s
    while True:
        session = json.loads((save_path / f"step_{step}" / "session.json").read_text())
        manifest = json.loads((save_path / f"step_{step}" / "manifest.json").read_text())
        entries = manifest["entries"]
        if (
            manifest["status"] == "complete"
            and len(session["clock_offsets"]) == 2
            and len(entries) == 3
            and all(e["clock_offset"] for e in entries)
        ):
            return manifest
        if time.monotonic() > deadline:
            raise AssertionError(f"step {step} never settled with every clock measured: {json.dumps(manifest)[:4000]}")
        time.sleep(0.25)


class Timeline:
    """One step's merged trace: forward steps per process and the trainer's control calls, in
    reference-clock nanoseconds, with or without the cross-process offsets."""

    def __init__(self, path: Path):
        trace = read_trace(path)
        meta = trace["rolloutProfiler"]
        self.base_ns = trace["baseTimeNanoseconds"]
        self.alignment = {a["key"]: a for a in meta["alignment"]}
        key_of: dict[int, str] = {}
        for ev in trace["traceEvents"]:
            if ev.get("ph") == "M" and ev.get("name") == "process_labels":
                facts = dict(f.split("=", 1) for f in ev["args"]["labels"].split(", ") if "=" in f)
                if "role" in facts:
                    ident = f"rank_{facts['rank']}" if facts["role"] == "trainer" else facts["replica"]
                    key_of[ev["pid"]] = f"{facts['role']}/{ident}"
        self.forward: list[tuple[str, int, int, int]] = []  # (key, step, begin_ns, end_ns)
        self.calls: dict[str, tuple[int, int]] = {}  # name -> (begin_ns, end_ns)
        for ev in trace["traceEvents"]:
            if ev.get("ph") != "X":
                continue
            begin = self.base_ns + round(ev["ts"] * 1000)
            end = begin + round(ev["dur"] * 1000)
            if ev["pid"] == 1 and ev["tid"] == 1:
                self.calls[ev["name"]] = (begin, end)
            elif (m := parse_forward_step(ev["name"])) and key_of.get(ev["pid"], "").startswith("rollout/"):
                self.forward.append((key_of[ev["pid"]], m.step, begin, end))

    def trainer(self) -> dict:
        return self.alignment["trainer/rank_0"]


def window_violations(timelines: dict[int, Timeline], corrected: bool) -> list[str]:
    """Replica forward steps of step k outside [start(k) sent, stop(k) answered], allowing each
    side's reported error; `corrected=False` takes the cross-process offsets back out."""
    found = []
    for k, tl in timelines.items():
        stop_call = tl.calls[f"stop step {k}"]
        start_call = timelines[k - 1].calls[f"start step {k}"] if k - 1 in timelines else None
        for key, step, begin, end in tl.forward:
            assert step == k, (key, step, k)
            a = tl.alignment[key]
            slack = a["uncertainty_ns"] + tl.trainer()["reference_bound_ns"]
            shift = 0
            if not corrected:  # the forward step back on its own clock, the calls on the trainer's
                shift = -a["reference_offset_ns"] + tl.trainer()["reference_offset_ns"]
                slack -= a["reference_bound_ns"] + tl.trainer()["reference_bound_ns"]
            if end + shift > stop_call[1] + slack:
                found.append(
                    f"{key} step {k}: a forward step ends {(end + shift - stop_call[1]) / 1e6:.1f} ms after "
                    f"stop({k}) answered"
                )
            if start_call is not None and begin + shift < start_call[0] - slack:
                found.append(
                    f"{key} step {k}: a forward step begins {(start_call[0] - begin - shift) / 1e6:.1f} ms before "
                    f"start({k}) was sent"
                )
    return found


def test_skewed_clocks_are_measured_and_corrected(skewed_app, model_dir, report_section):
    app, skewed_pid, site = skewed_app
    say = report_section("clock offsets measured under libfaketime (tests/integration/test_clock_skew.py)")
    weights = write_perturbed_weights(model_dir, app.weights_dir / "v.safetensors", seed=3)
    run_skewed_trainer(app, weights, site)

    store = TraceStore(app.save_path)
    timelines = {}
    say("\nstep  process                 true shift ms  measured offset ms   bound ms")
    for k in STEPS:
        manifest = settled_manifest(app.save_path, k)
        for e in manifest["entries"]:
            if e["role"] == "trainer":
                true_offset = -TRAINER_SHIFT_NS
            else:
                true_offset = -REPLICA_SHIFT_NS if e["pid"] == skewed_pid else 0
            off = e["clock_offset"]
            say(
                f"{k:>4}  {e['replica_id'] or 'trainer'!s:<22} {-true_offset / 1e6:>13.1f}  "
                f"{off['offset_ns'] / 1e6:>18.3f}  {off['bound_ns'] / 1e6:>9.3f}"
            )
            assert abs(off["offset_ns"] - true_offset) <= off["bound_ns"], (k, e)
        assert skewed_pid in {e["pid"] for e in manifest["entries"]}, "the skewed replica recorded no trace"
        record = merge_step(store, k)
        assert record is not None and record.status == "ok"
        timelines[k] = Timeline(app.save_path / f"step_{k}" / record.path)
        for a in timelines[k].alignment.values():
            assert a["source"] == "clock_sync" and a["reference_bound_ns"] is not None, a

    for k, tl in timelines.items():
        stop_call, update, start = (
            tl.calls[f"stop step {k}"],
            tl.calls[f"update_weights v{k}"],
            tl.calls.get(f"start step {k + 1}"),
        )
        assert stop_call[1] <= update[0] + 1000 and (start is None or update[1] <= start[0] + 1000), tl.calls
        assert {key for key, *_ in tl.forward} == {key for key in tl.alignment if key.startswith("rollout/")}
    assert window_violations(timelines, corrected=True) == []
    uncorrected = window_violations(timelines, corrected=False)
    assert uncorrected, "without the cross-process offsets the windows should not hold"
    say(f"without the correction: {len(uncorrected)} violations, e.g. {uncorrected[0]}")
