"""Which weight versions one process's windows recorded: forward steps counted by version, and
the window that started on each version and recorded it alone (no weight load fell inside it),
the one whose trace shows that version's steps with nothing else mixed in."""

from __future__ import annotations

from profiling.manifest import ManifestEntry


class VersionWindows:
    """The weight-version bookkeeping of profiling/session.py, on the model thread."""

    def __init__(self) -> None:
        self._recorded: dict[int, int] = {}
        # Weight version -> the last window that started on it; windows a weight load fell in.
        self._started_on: dict[int, int] = {}
        self._spanning: set[int] = set()

    def recorded_by_version(self) -> dict[int, int]:
        """Forward steps recorded, by weight version."""
        return dict(self._recorded)

    def started(self, step: int, version: int) -> None:
        """Window `step` starts recording on weights `version`."""
        self._started_on[version] = step
        self._spanning.discard(step)

    def count(self, entry: ManifestEntry, version: int) -> None:
        """One forward step on weights `version` was recorded into `entry`."""
        entry.forward_steps += 1
        self._recorded[version] = self._recorded.get(version, 0) + 1
        if version not in entry.weight_versions:
            entry.weight_versions.append(version)

    def weight_load(self, active_step: int | None) -> None:
        """The engine loads new weights now: the active window (if any) spans two versions."""
        if active_step is not None:
            self._spanning.add(active_step)

    def step_started_on(self, version: int, active_step: int | None) -> int | None:
        """The closed window that started on weights `version` and recorded them alone (None:
        there is none)."""
        step = self._started_on.get(version)
        if step is None or step == active_step or step in self._spanning:
            return None
        return step
