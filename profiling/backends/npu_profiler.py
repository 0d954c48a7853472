"""torch_npu.profiler backend (Ascend NPU).

torch_npu writes its own output: `tensorboard_trace_handler(dir_name, analyse_flag=...)` needs the
directory when the profiler is built, creates `<host>_<pid>_<timestamp>_ascend_pt/` in it, fills it
while recording and, with `analyse_flag`, parses it when the recording stops. The backend does not
know the session's `out_dir` at start (the session hands it to `export`), so it records into a
private staging directory (under $TMPDIR) and `export` moves every directory torch_npu made there
into `out_dir`, renamed into place only once fully moved. The file names are not known in advance
(`trace_files` is empty); `export` returns every file it moved.

Forward-step and weight-update markers are mstx ranges (`torch_npu.npu.mstx.range_start/range_end`),
collected because the experimental config sets `mstx=True`.

Tested only against a fake torch_npu on CPU (tests/unit/test_npu_backend.py), never on Ascend.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from profiling.backends.base import ProfilerBackend, RecordedTrace
from profiling.config import ProfileOptions

MISSING_TORCH_NPU = "tool 'npu' needs torch_npu (Ascend); install torch_npu or use tool: torch"

_LEVELS = {"level_none": "Level_none", "level0": "Level0", "level1": "Level1", "level2": "Level2"}
_EXPORT_TYPES = {"text": "Text", "db": "Db"}
_MSTX_MESSAGE_BYTES = 150
"""torch_npu documents at most 156 bytes for an mstx message (255 with MSPTI)."""


def import_torch_npu() -> ModuleType:
    """`torch_npu` with its profiler imported, or a RuntimeError that names the fix."""
    try:
        import torch_npu
        import torch_npu.profiler
    except (ImportError, OSError) as e:  # OSError: the wheel is there but CANN's libraries are not
        raise RuntimeError(f"{MISSING_TORCH_NPU} (import failed: {e})") from e
    return torch_npu


def profile_kwargs(options: ProfileOptions, torch_npu: ModuleType) -> tuple[dict[str, Any], dict[str, Any]]:
    """The `_ExperimentalConfig(...)` and `profile(...)` keyword arguments for these options
    (`profile` without `experimental_config` and `on_trace_ready`, which need live objects)."""
    tp = torch_npu.profiler
    npu = options.npu
    contents = set(npu.contents)
    experimental: dict[str, Any] = {
        "profiler_level": getattr(tp.ProfilerLevel, _LEVELS[npu.level]),
        "export_type": getattr(tp.ExportType, _EXPORT_TYPES[npu.export_type]),
        "data_simplification": npu.data_simplification,
        "mstx": True,  # collect the forward-step / weight-update ranges of `mark`
    }
    if npu.aic_metrics is not None:
        experimental["aic_metrics"] = getattr(tp.AiCMetrics, npu.aic_metrics)
    record_all = not contents & {"npu", "cpu"}
    activities = [
        activity
        for name, activity in (("cpu", tp.ProfilerActivity.CPU), ("npu", tp.ProfilerActivity.NPU))
        if record_all or name in contents
    ]
    profile = {
        "activities": activities,
        "record_shapes": "shapes" in contents or options.record_shapes,
        "profile_memory": "memory" in contents or options.with_memory,
        "with_stack": "stack" in contents or options.with_stack,
        "with_modules": "module" in contents,
    }
    return experimental, profile


class NpuRecordedTrace(RecordedTrace):
    """torch_npu's finished output, still in the staging directory until `export` moves it."""

    def __init__(self, staging: Path):
        self.staging = staging

    def export(self, out_dir: Path) -> list[Path]:
        produced = sorted(self.staging.iterdir()) if self.staging.is_dir() else []
        if not produced:
            raise RuntimeError(f"torch_npu wrote no profiling data under {self.staging}")
        out_dir.mkdir(parents=True, exist_ok=True)
        files: list[Path] = []
        for src in produced:
            dest = out_dir / src.name
            if dest.exists():
                raise FileExistsError(f"{dest} already exists; not overwriting it with {src}")
            partial = out_dir / f".{src.name}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            shutil.move(src, partial)  # a copy when staging is on another filesystem
            os.replace(partial, dest)  # then one rename: readers never see half a directory
            files.extend(sorted(p for p in dest.rglob("*") if p.is_file()) if dest.is_dir() else [dest])
        shutil.rmtree(self.staging, ignore_errors=True)
        return files


class NpuProfilerBackend(ProfilerBackend):
    """One torch_npu.profiler recording per window, started and stopped on the model thread."""

    trace_files = ()  # torch_npu names its directory at start (host, pid, timestamp)

    def __init__(self, options: ProfileOptions):
        super().__init__(options)
        if "cuda" in options.activities:
            raise RuntimeError(
                "tool 'npu' takes its activities from profiler.npu.contents (npu, cpu); "
                "activities: [cuda] is for tool: torch"
            )
        self._torch_npu = import_torch_npu()
        self._prof: Any = None
        self._staging: Path | None = None

    def _start(self) -> None:
        tp = self._torch_npu.profiler
        experimental, kwargs = profile_kwargs(self.options, self._torch_npu)
        analyse = self.options.npu.analysis
        temp = Path(tempfile.gettempdir())
        free_mb = shutil.disk_usage(temp).free / 2**20
        if free_mb < self.options.npu.min_free_staging_mb:
            raise RuntimeError(
                f"not started: the staging directory ($TMPDIR, {temp.name}) has {free_mb:.0f} MiB free, below "
                f"profiler.npu.min_free_staging_mb={self.options.npu.min_free_staging_mb:.0f}; torch_npu's raw "
                "data would not fit: free disk space or point TMPDIR at a larger disk"
            )
        staging = Path(tempfile.mkdtemp(prefix="npu-profile-"))
        try:
            prof = tp.profile(
                **kwargs,
                experimental_config=tp._ExperimentalConfig(**experimental),
                on_trace_ready=tp.tensorboard_trace_handler(str(staging), analyse_flag=analyse),
            )
            prof.start()
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self._prof, self._staging = prof, staging

    def _stop(self) -> RecordedTrace:
        prof, staging = self._prof, self._staging
        self._prof = self._staging = None
        assert prof is not None and staging is not None
        try:
            prof.stop()  # on_trace_ready fires here; with analyse_flag torch_npu parses inline
        except Exception as e:
            raise RuntimeError(f"torch_npu profiler stop failed (raw data left in {staging}): {e}") from e
        return NpuRecordedTrace(staging)

    @contextlib.contextmanager
    def mark(self, name: str) -> Iterator[None]:
        mstx = self._torch_npu.npu.mstx
        message = name.encode()[:_MSTX_MESSAGE_BYTES].decode(errors="ignore")
        range_id = mstx.range_start(message, None)  # stream None: a host-side range
        try:
            yield
        finally:
            if range_id:  # 0: torch_npu could not open the range
                mstx.range_end(range_id)
