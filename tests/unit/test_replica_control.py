"""The replica's control plane without Ray: each control call answers a report with one outcome,
and every failure takes one path into it (the app's own errors keep their text, any other is
named by the call and its first line, with no server path). The engine is a fake, named as one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from profiling.config import ProfileOptions
from profiling.session import SessionConflict, SessionSpec, StopOutcome
from serve_app.admission import GenerationGate
from serve_app.api import EngineRpcReport, Outcome, PerReplica, ReplicaReport
from serve_app.config import AppArgs
from serve_app.engines.controller import EngineStatus
from serve_app.engines.weight_control import AdoptConflict, AdoptRefused
from serve_app.limits import RequestLimits
from serve_app.replica.control import ControlPlane
from serve_app.weights.safetensors_file import WeightsError


class FakeEngine:
    """Raises what `fail` holds from the next call, else answers like an engine."""

    def __init__(self) -> None:
        self.fail: Exception | None = None
        self.weight_version = 0
        self.transfer_ranks = 1
        self.client_held = False
        self.client_aborting = False
        self.rpc_calls: list[tuple[str, tuple[Any, ...]]] = []

    def status(self) -> EngineStatus:
        return EngineStatus(
            state="idle",
            active_step=None,
            weight_version=self.weight_version,
            paused=False,
            forward_steps=0,
            forward_steps_by_version={},
            requests_in_flight=0,
        )

    def _maybe_fail(self) -> None:
        if (e := self.fail) is not None:
            raise e

    async def start_profile(self, spec: SessionSpec) -> bool:
        self._maybe_fail()
        return True

    async def stop_profile(self, step: int | None, pause: bool) -> StopOutcome:
        self._maybe_fail()
        return StopOutcome(step=step, stopped=True, files=["a.json.gz"], forward_steps=7)

    async def update_weights(self, version: int, path: str | None, resume: bool) -> float:
        self._maybe_fail()
        self.weight_version = version
        return 0.25

    async def adopt_weights(self, version: int, resume: bool) -> None:
        self._maybe_fail()

    async def engine_rpc(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self._maybe_fail()
        self.rpc_calls.append((method, args))
        return {"answered": method}


class Replica(ControlPlane):
    def __init__(self, engine: FakeEngine, save_path: Path):
        self.engine = engine  # type: ignore[assignment]
        self.replica_id = "r1"
        self._args = AppArgs(save_path=str(save_path))
        self._gate = GenerationGate(RequestLimits())
        self._node_id = "node"
        self._node_dir = save_path
        self._redact = lambda text: text.replace(str(save_path), "<save_path>")


@pytest.fixture
def replica(tmp_path: Path) -> Replica:
    return Replica(FakeEngine(), tmp_path)


def spec() -> SessionSpec:
    return SessionSpec(step=1, steps=[1], options=ProfileOptions())


@pytest.mark.parametrize(
    ("flags", "outcome"),
    [
        ({}, Outcome.OK),
        ({"ok": False}, Outcome.FAILED),
        ({"ok": False, "conflict": True}, Outcome.CONFLICT),
        ({"ok": False, "refused": True}, Outcome.REFUSED),
    ],
)
def test_a_report_holds_one_outcome_and_its_flags_round_trip(flags: dict[str, bool], outcome: Outcome) -> None:
    report = ReplicaReport(replica_id="r", **flags)
    assert report.outcome is outcome
    assert ReplicaReport.model_validate_json(report.model_dump_json()).outcome is outcome
    assert ReplicaReport(replica_id="r", **outcome.flags()).outcome is outcome


@pytest.mark.parametrize(
    "flags", [{"ok": False, "conflict": True, "refused": True}, {"conflict": True}, {"ok": True, "refused": True}]
)
def test_a_report_with_two_outcomes_is_refused_when_read(flags: dict[str, bool]) -> None:
    with pytest.raises(ValidationError, match=r"not ok|not both"):
        ReplicaReport(replica_id="r", **flags)


async def test_calls_that_succeed_report_their_fields(replica: Replica) -> None:
    started = await replica.start_profile(spec())
    assert started.outcome is Outcome.OK and started.state == "profiling" and started.replica_id == "r1"
    stopped = await replica.stop_profile(1, pause=False)
    assert stopped.files == ["a.json.gz"] and stopped.forward_steps == 7 and stopped.stop_ack_s is not None
    updated = await replica.update_weights(3, "w.safetensors", resume=True)
    assert updated.outcome is Outcome.OK and updated.load_s == 0.25 and updated.weight_version == 3


@pytest.mark.parametrize(
    ("call", "raised", "outcome", "error"),
    [
        ("start", SessionConflict("r1 is profiling step 4"), Outcome.CONFLICT, "r1 is profiling step 4"),
        ("start", RuntimeError("no CUDA\nlong tail"), Outcome.REFUSED, "start failed: RuntimeError: no CUDA"),
        ("stop", SessionConflict("step 2 is not recording"), Outcome.CONFLICT, "step 2 is not recording"),
        ("stop", OSError("disk\nmore"), Outcome.FAILED, "stop failed: OSError: disk"),
        ("update", WeightsError("shape of lm_head differs"), Outcome.FAILED, "shape of lm_head differs"),
        ("update", KeyError("x"), Outcome.FAILED, "weight update failed: KeyError: 'x'"),
        ("adopt", AdoptRefused("keeps no weight version"), Outcome.REFUSED, "keeps no weight version"),
        ("adopt", AdoptConflict("reports version 2"), Outcome.CONFLICT, "reports version 2"),
        ("adopt", ValueError("odd"), Outcome.FAILED, "could not adopt version 5: ValueError: odd"),
    ],
)
async def test_every_failure_takes_one_path_into_the_report(
    replica: Replica, call: str, raised: Exception, outcome: Outcome, error: str
) -> None:
    replica.engine.fail = raised  # type: ignore[attr-defined]
    calls = {
        "start": lambda: replica.start_profile(spec()),
        "stop": lambda: replica.stop_profile(2, pause=False),
        "update": lambda: replica.update_weights(5, "w", resume=True),
        "adopt": lambda: replica.adopt_weights(5, resume=True),
    }
    report = await calls[call]()
    assert (report.outcome, report.error) == (outcome, error)
    assert report.ok is False and report.replica_id == "r1"


async def test_a_failure_names_no_server_path(replica: Replica, tmp_path: Path) -> None:
    replica.engine.fail = WeightsError(f"cannot read {tmp_path}/w.safetensors")  # type: ignore[attr-defined]
    report = await replica.update_weights(1, "w", resume=True)
    assert report.error == "cannot read <save_path>/w.safetensors"


async def test_a_replica_that_is_not_a_member_of_a_transfer_says_so(replica: Replica) -> None:
    report = await replica.receive_weights(2, None, {"r9": 0}, 2)  # type: ignore[arg-type]
    assert report.outcome is Outcome.FAILED and "not a member of the transfer of version 2" in (report.error or "")


async def test_engine_rpc_answers_its_result_per_replica_and_its_failure_in_the_same_shape(replica: Replica) -> None:
    answered = await replica.engine_rpc("collective_rpc", [PerReplica(values={"r1": 3})], {})
    assert isinstance(answered, EngineRpcReport) and answered.result == {"answered": "collective_rpc"}
    assert replica.engine.rpc_calls == [("collective_rpc", (3,))]  # type: ignore[attr-defined]
    missing = await replica.engine_rpc("collective_rpc", [PerReplica(values={"r2": 3})], {})
    assert isinstance(missing, EngineRpcReport) and missing.outcome is Outcome.FAILED and missing.result is None
    assert (missing.error or "").startswith("engine rpc collective_rpc failed: ValueError: a PerReplica argument")
