"""The npu backend against FakeTorchNpu, a fake of torch_npu's profiler surface, on CPU.

FakeTorchNpu is NOT torch_npu: it copies the signatures and output layout that
docs/npu.md#torch-npu-api gives for torch-npu 2.14 (`profile`, `_ExperimentalConfig`,
`tensorboard_trace_handler`, the enums, `npu.mstx`), records every call with its arguments, and
writes a plausible `<host>_<pid>_<ts>_ascend_pt/` directory. Nothing here was
run against real torch_npu or an Ascend device.
"""

from __future__ import annotations

import enum
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import pytest

from profiling.backends import create_backend
from profiling.backends.npu_profiler import MISSING_TORCH_NPU, NpuProfilerBackend
from profiling.config import ProfileOptions
from profiling.manifest import ManifestEntry
from profiling.session import ProfileSession

RID = "replica-0"
WAIT = 20.0


# -- the fake --------------------------------------------------------------------------------


class FakeProfilerActivity(enum.Enum):
    CPU = "CPU"
    NPU = "NPU"


class FakeProfilerLevel:
    Level0 = "fake:Level0"
    Level1 = "fake:Level1"
    Level2 = "fake:Level2"
    Level_none = "fake:Level_none"


class FakeAiCMetrics:
    PipeUtilization = "fake:ACL_AICORE_PIPE_UTILIZATION"
    ArithmeticUtilization = "fake:ACL_AICORE_ARITHMETIC_UTILIZATION"
    Memory = "fake:ACL_AICORE_MEMORY_BANDWIDTH"
    MemoryL0 = "fake:ACL_AICORE_L0B_AND_WIDTH"
    MemoryUB = "fake:ACL_AICORE_MEMORY_UB"
    ResourceConflictRatio = "fake:ACL_AICORE_RESOURCE_CONFLICT_RATIO"
    L2Cache = "fake:ACL_AICORE_L2_CACHE"
    MemoryAccess = "fake:ACL_AICORE_MEMORY_ACCESS"
    AiCoreNone = "fake:ACL_AICORE_NONE"


class FakeExportType:
    Text = "text"
    Db = "db"


class FakeTorchNpu(types.ModuleType):
    """A fake `torch_npu` module: `torch_npu.profiler` and `torch_npu.npu.mstx`, recording calls."""

    def __init__(self, write_output: bool = True):
        super().__init__("torch_npu")
        self.calls: list[tuple[str, dict]] = []
        self.write_output = write_output
        self.active: FakeProfile | None = None
        self.profiles: list[FakeProfile] = []
        fake = self

        class _ExperimentalConfig:
            # argument names and defaults as docs/npu.md#torch-npu-api lists them
            def __init__(
                self,
                profiler_level=FakeProfilerLevel.Level0,
                aic_metrics=FakeAiCMetrics.PipeUtilization,
                l2_cache=False,
                msprof_tx=False,
                mstx=False,
                data_simplification=True,
                record_op_args=False,
                op_attr=False,
                gc_detect_threshold=None,
                export_type=FakeExportType.Text,
                host_sys=None,
                mstx_domain_include=None,
                mstx_domain_exclude=None,
                sys_io=False,
                sys_interconnection=False,
            ):
                self.profiler_level, self.aic_metrics, self.mstx = profiler_level, aic_metrics, mstx
                self.msprof_tx, self.export_type = msprof_tx, export_type
                self.data_simplification = data_simplification

        def _experimental_config(**kwargs):
            fake.calls.append(("_ExperimentalConfig", kwargs))
            return _ExperimentalConfig(**kwargs)

        def tensorboard_trace_handler(dir_name=None, worker_name=None, analyse_flag=True, async_mode=False):
            fake.calls.append(
                (
                    "tensorboard_trace_handler",
                    {"dir_name": dir_name, "worker_name": worker_name, "analyse_flag": analyse_flag,
                     "async_mode": async_mode},
                )
            )
            return FakeTraceHandler(fake, dir_name, worker_name, analyse_flag)

        def profile(**kwargs):
            fake.calls.append(("profile", kwargs))
            prof = FakeProfile(fake, **kwargs)
            fake.profiles.append(prof)
            return prof

        profiler = types.ModuleType("torch_npu.profiler")
        profiler.ProfilerActivity = FakeProfilerActivity
        profiler.ProfilerLevel = FakeProfilerLevel
        profiler.AiCMetrics = FakeAiCMetrics
        profiler.ExportType = FakeExportType
        profiler._ExperimentalConfig = _experimental_config
        profiler.tensorboard_trace_handler = tensorboard_trace_handler
        profiler.profile = profile
        self.profiler = profiler

        ids = iter(range(1, 10**9))

        def range_start(message="None", stream=None, domain="default"):
            fake.calls.append(("mstx.range_start", {"message": message, "stream": stream, "domain": domain}))
            rid = next(ids)
            if fake.active is not None:
                fake.active.ranges[rid] = {"name": message, "ts": time.time_ns() / 1e3}
            return rid

        def range_end(range_id, domain="default"):
            fake.calls.append(("mstx.range_end", {"range_id": range_id, "domain": domain}))
            if fake.active is not None and range_id in fake.active.ranges:
                r = fake.active.ranges[range_id]
                r["dur"] = time.time_ns() / 1e3 - r["ts"]

        self.npu = types.ModuleType("torch_npu.npu")
        self.npu.mstx = types.SimpleNamespace(range_start=range_start, range_end=range_end)

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def kwargs_of(self, name: str) -> dict:
        [kw] = [kw for n, kw in self.calls if n == name]
        return kw


class FakeTraceHandler:
    """What `tensorboard_trace_handler` returns: owns the output directory, parses on trace-ready."""

    def __init__(self, fake: FakeTorchNpu, dir_name, worker_name, analyse_flag):
        self.fake, self.dir_name, self.worker_name, self.analyse_flag = fake, dir_name, worker_name, analyse_flag

    def make_output_dir(self) -> Path:
        ts = time.strftime("%Y%m%d%H%M%S") + f"{int(time.time() * 1000) % 1000:03d}"
        name = f"{self.worker_name or socket.gethostname()}_{os.getpid()}_{ts}_ascend_pt"
        out = Path(self.dir_name or ".") / name
        out.mkdir(parents=True)
        return out

    def __call__(self, prof: FakeProfile) -> None:
        self.fake.calls.append(("trace_ready", {"analyse_flag": self.analyse_flag}))
        if not self.fake.write_output:
            return
        assert prof.output_dir is not None
        out = prof.output_dir / "ASCEND_PROFILER_OUTPUT"
        if not self.analyse_flag:
            return
        out.mkdir()
        if prof.experimental_config.export_type == FakeExportType.Db:
            (out / "ascend_pytorch_profiler_0.db").write_bytes(b"SQLite format 3\x00fake")
            return
        events = [
            {"name": r["name"], "ph": "X", "ts": r["ts"], "dur": r.get("dur", 0), "pid": os.getpid(),
             "tid": 0, "cat": "mstx"}
            for r in prof.ranges.values()
        ]
        (out / "trace_view.json").write_text(json.dumps(events))
        (out / "operator_details.csv").write_text("Name,Count\nfake_op,1\n")


class FakeProfile:
    """What `torch_npu.profiler.profile(...)` returns; its keyword arguments are torch_npu's."""

    def __init__(
        self,
        fake: FakeTorchNpu,
        *,
        activities=None,
        schedule=None,
        on_trace_ready=None,
        record_shapes=False,
        profile_memory=False,
        with_stack=False,
        with_flops=False,
        with_modules=False,
        experimental_config=None,
        execution_trace_observer=None,
        custom_trace_id_callback=None,
        use_cuda=None,
    ):
        self.fake, self.on_trace_ready, self.experimental_config = fake, on_trace_ready, experimental_config
        self.output_dir: Path | None = None
        self.ranges: dict[int, dict] = {}

    def start(self) -> None:
        self.fake.calls.append(("profile.start", {}))
        if self.fake.write_output:
            self.output_dir = self.on_trace_ready.make_output_dir()
            (self.output_dir / "profiler_info.json").write_text(json.dumps({"config": "fake"}))
        self.fake.active = self if self.experimental_config.mstx else None

    def stop(self) -> None:
        self.fake.calls.append(("profile.stop", {}))
        self.fake.active = None
        if self.output_dir is not None:
            raw = self.output_dir / "FRAMEWORK"
            raw.mkdir()
            (raw / "torch.op_range").write_bytes(b"\x00fake raw host data")
            dev = self.output_dir / "PROF_000001_fake" / "device_0" / "data"
            dev.mkdir(parents=True)
            (dev / "task_time.data.0.slice_0").write_bytes(b"\x00fake raw device data")
        self.on_trace_ready(self)


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture
def fake(monkeypatch) -> FakeTorchNpu:
    fake = FakeTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setitem(sys.modules, "torch_npu.profiler", fake.profiler)
    monkeypatch.setitem(sys.modules, "torch_npu.npu", fake.npu)
    return fake


@pytest.fixture
def staging_root(tmp_path, monkeypatch) -> Path:
    """Where the backend's staging directories go (tempfile's default dir, as $TMPDIR sets it)."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def npu_options(**npu) -> ProfileOptions:
    return ProfileOptions(tool="npu", max_duration_s=None, npu=npu)


def session(store, exporter) -> ProfileSession:
    # backend_factory left at its default: create_backend picks the npu backend from options.tool
    return ProfileSession(store=store, entry_identity=ManifestEntry(role="rollout", replica_id=RID), exporter=exporter)


# -- option mapping --------------------------------------------------------------------------


def started(fake: FakeTorchNpu, options: ProfileOptions) -> tuple[dict, dict, dict]:
    backend = create_backend(options)
    assert isinstance(backend, NpuProfilerBackend)
    backend.start()
    backend.stop()
    return (
        fake.kwargs_of("_ExperimentalConfig"),
        fake.kwargs_of("profile"),
        fake.kwargs_of("tensorboard_trace_handler"),
    )


def test_a_start_without_room_to_stage_is_refused_naming_the_setting(fake, staging_root, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**10, 10**10 - 2**20, 2**20))
    backend = create_backend(npu_options(min_free_staging_mb=100))
    with pytest.raises(RuntimeError, match="min_free_staging_mb=100"):
        backend.start()
    assert not backend.recording and not list(staging_root.iterdir())
    create_backend(npu_options(min_free_staging_mb=0)).start()  # the bound is the setting's


def test_defaults_map_onto_torch_npu(fake, staging_root):
    exp, prof, handler = started(fake, npu_options())
    assert exp == {
        "profiler_level": FakeProfilerLevel.Level0,
        "export_type": FakeExportType.Text,
        "data_simplification": True,
        "mstx": True,
    }  # aic_metrics not passed: torch_npu's default
    assert prof["activities"] == [FakeProfilerActivity.CPU, FakeProfilerActivity.NPU]
    assert (prof["record_shapes"], prof["profile_memory"], prof["with_stack"], prof["with_modules"]) == (
        False, False, False, False,
    )
    assert prof["experimental_config"].mstx is True
    assert isinstance(prof["on_trace_ready"], FakeTraceHandler)
    assert handler["analyse_flag"] is True and handler["async_mode"] is False
    assert Path(handler["dir_name"]).parent == staging_root


@pytest.mark.parametrize(
    ("level", "expected"),
    [
        ("level_none", FakeProfilerLevel.Level_none),
        ("level0", FakeProfilerLevel.Level0),
        ("level1", FakeProfilerLevel.Level1),
        ("level2", FakeProfilerLevel.Level2),
    ],
)
def test_level_maps_to_profiler_level(fake, staging_root, level, expected):
    exp, _, _ = started(fake, npu_options(level=level))
    assert exp["profiler_level"] == expected


@pytest.mark.parametrize(
    ("contents", "activities", "flags"),
    [
        # flags: record_shapes, profile_memory, with_stack, with_modules
        ([], ["CPU", "NPU"], (False, False, False, False)),
        (["npu"], ["NPU"], (False, False, False, False)),
        (["cpu"], ["CPU"], (False, False, False, False)),
        (["npu", "cpu"], ["CPU", "NPU"], (False, False, False, False)),
        (["shapes"], ["CPU", "NPU"], (True, False, False, False)),
        (["memory"], ["CPU", "NPU"], (False, True, False, False)),
        (["stack"], ["CPU", "NPU"], (False, False, True, False)),
        (["module"], ["CPU", "NPU"], (False, False, False, True)),
        (["npu", "cpu", "memory", "shapes", "module", "stack"], ["CPU", "NPU"], (True, True, True, True)),
    ],
)
def test_contents_map_to_activities_and_flags(fake, staging_root, contents, activities, flags):
    _, prof, _ = started(fake, npu_options(contents=contents))
    assert prof["activities"] == [FakeProfilerActivity[a] for a in activities]
    assert (prof["record_shapes"], prof["profile_memory"], prof["with_stack"], prof["with_modules"]) == flags


def test_top_level_flags_also_switch_npu_extras_on(fake, staging_root):
    options = ProfileOptions(tool="npu", record_shapes=True, with_stack=True, with_memory=True)
    _, prof, _ = started(fake, options)
    assert (prof["record_shapes"], prof["profile_memory"], prof["with_stack"], prof["with_modules"]) == (
        True, True, True, False,
    )


def test_analysis_maps_to_analyse_flag(fake, staging_root):
    _, _, handler = started(fake, npu_options(analysis=False))
    assert handler["analyse_flag"] is False


@pytest.mark.parametrize("name", ["PipeUtilization", "Memory", "L2Cache", "AiCoreNone"])
def test_aic_metrics_maps_by_name(fake, staging_root, name):
    exp, _, _ = started(fake, npu_options(aic_metrics=name))
    assert exp["aic_metrics"] == getattr(FakeAiCMetrics, name)


@pytest.mark.parametrize(("export_type", "expected"), [("text", FakeExportType.Text), ("db", FakeExportType.Db)])
def test_export_type_and_data_simplification(fake, staging_root, export_type, expected):
    exp, _, _ = started(fake, npu_options(export_type=export_type, data_simplification=False))
    assert exp["export_type"] == expected and exp["data_simplification"] is False


def test_cuda_activity_is_rejected_for_npu(fake):
    with pytest.raises(RuntimeError, match=r"profiler\.npu\.contents"):
        create_backend(ProfileOptions(tool="npu", activities=["cpu", "cuda"]))


# -- call order and markers ------------------------------------------------------------------


def test_calls_in_order_with_mstx_ranges(fake, staging_root):
    backend = create_backend(npu_options())
    backend.start()
    with backend.mark("forward_step#0 step=1 weight_version=0"):
        pass
    trace = backend.stop()
    assert fake.names() == [
        "_ExperimentalConfig",
        "tensorboard_trace_handler",
        "profile",
        "profile.start",
        "mstx.range_start",
        "mstx.range_end",
        "profile.stop",
        "trace_ready",
    ]
    start = fake.calls[4][1]
    assert start == {"message": "forward_step#0 step=1 weight_version=0", "stream": None, "domain": "default"}
    assert fake.calls[5][1]["range_id"] == 1
    # torch_npu's output stays in staging until export
    [produced] = next(iter(staging_root.iterdir())).iterdir()
    assert produced.name.startswith(f"{socket.gethostname()}_{os.getpid()}_") and produced.name.endswith("_ascend_pt")
    assert trace is not None


def test_long_marker_is_cut_to_the_mstx_limit(fake, staging_root):
    backend = create_backend(npu_options())
    backend.start()
    with backend.mark("x" * 400):
        pass
    backend.stop()
    assert len(fake.kwargs_of("mstx.range_start")["message"].encode()) <= 150


# -- a full session cycle ----------------------------------------------------------------------


def test_session_cycle_exports_under_the_replica_dir(fake, staging_root, store, exporter, spec):
    s = session(store, exporter)
    assert s.start(spec(3, tool="npu", max_duration_s=None), weight_version=2)
    [early] = store.read_entries(3)
    assert early.exporting is True and early.files == []  # torch_npu names its files itself
    for _ in range(3):
        with s.forward_step(weight_version=2):
            pass
    out = s.stop(3)
    assert out.stopped and out.forward_steps == 3

    final = s.wait_exported(3, timeout=WAIT)
    assert final is not None
    assert final.status == "ok" and final.error is None and final.exporting is False
    assert final.forward_steps == 3 and final.bytes > 0
    replica_dir = store.rollout_dir(3, RID)
    [ascend_dir] = [p for p in replica_dir.iterdir() if p.is_dir()]
    assert ascend_dir.name.endswith("_ascend_pt")
    prefix = f"rollout/{RID}/{ascend_dir.name}/"
    assert all(f.startswith(prefix) for f in final.files)
    assert {f[len(prefix):] for f in final.files} == {
        "profiler_info.json",
        "FRAMEWORK/torch.op_range",
        "PROF_000001_fake/device_0/data/task_time.data.0.slice_0",
        "ASCEND_PROFILER_OUTPUT/trace_view.json",
        "ASCEND_PROFILER_OUTPUT/operator_details.csv",
    }
    assert final.bytes == sum((store.step_dir(3) / f).stat().st_size for f in final.files)
    events = json.loads((ascend_dir / "ASCEND_PROFILER_OUTPUT" / "trace_view.json").read_text())
    assert [e["name"] for e in events] == [f"forward_step#{i} step=3 weight_version=2" for i in range(3)]

    m = store.read_manifest(3)
    assert m is not None and m.status == "complete" and m.entries == [final]
    assert list(staging_root.iterdir()) == []  # staging removed
    assert [p.name for p in replica_dir.iterdir() if p.name.startswith(".")] == []  # no partial dirs


def test_session_cycle_db_export_without_analysis(fake, staging_root, store, exporter, spec):
    s = session(store, exporter)
    s.start(spec(1, tool="npu", max_duration_s=None, npu={"analysis": False, "export_type": "db"}), weight_version=0)
    with s.forward_step(weight_version=0):
        pass
    s.stop(1)
    final = s.wait_exported(1, timeout=WAIT)
    assert final.status == "ok"
    assert not any("ASCEND_PROFILER_OUTPUT" in f for f in final.files)  # raw data only: parse offline
    assert any(f.endswith("FRAMEWORK/torch.op_range") for f in final.files)


def test_session_cycle_db_export_with_analysis(fake, staging_root, store, exporter, spec):
    s = session(store, exporter)
    s.start(spec(1, tool="npu", max_duration_s=None, npu={"export_type": "db"}), weight_version=0)
    s.stop(1)
    final = s.wait_exported(1, timeout=WAIT)
    assert final.status == "ok"
    assert any(f.endswith("ASCEND_PROFILER_OUTPUT/ascend_pytorch_profiler_0.db") for f in final.files)


def test_no_output_from_torch_npu_is_an_error_entry(monkeypatch, staging_root, store, exporter, spec):
    fake = FakeTorchNpu(write_output=False)
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setitem(sys.modules, "torch_npu.profiler", fake.profiler)
    s = session(store, exporter)
    s.start(spec(2, tool="npu", max_duration_s=None), weight_version=1)
    s.stop(2)
    final = s.wait_exported(2, timeout=WAIT)
    assert final.status == "error" and "torch_npu wrote no profiling data" in final.error
    assert final.files == []
    assert store.read_manifest(2).status == "partial"


# -- without torch_npu -------------------------------------------------------------------------


def test_clear_error_without_torch_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu -> ImportError
    with pytest.raises(RuntimeError) as ei:
        create_backend(ProfileOptions(tool="npu"))
    assert str(ei.value).startswith(MISSING_TORCH_NPU)
    assert MISSING_TORCH_NPU == "tool 'npu' needs torch_npu (Ascend); install torch_npu or use tool: torch"


def test_session_start_without_torch_npu_stays_idle(monkeypatch, store, exporter, spec):
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    s = session(store, exporter)
    with pytest.raises(RuntimeError, match="tool 'npu' needs torch_npu"):
        s.start(spec(1, tool="npu", max_duration_s=None), weight_version=0)
    assert s.state == "idle" and s.active_step is None
    assert not store.step_dir(1).exists()  # no entry left claiming a recording


def test_importing_profiling_imports_neither_torch_npu_nor_ray_nor_http():
    code = (
        "import sys, profiling, profiling.config, profiling.session, profiling.backends, "
        "profiling.backends.factory, profiling.backends.npu_profiler, profiling.backends.nsys_profiler\n"
        "bad = [m for m in ('torch_npu', 'ray', 'fastapi', 'httpx', 'starlette', 'uvicorn') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
