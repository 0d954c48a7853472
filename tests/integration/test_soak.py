"""The soak benchmark's smaller version (benchmarks/soak.py): 100 start/stop cycles under 8
generating clients with a weight update every 10 cycles, against the real 2-replica app.

Profiling back to back is faster than traces can be written on 2 cores, so the app's export
backlog bound (429 on start, waited out by the trainer's client) is what keeps memory bounded here.
"""

from __future__ import annotations

import pytest

from benchmarks.soak import soak

pytestmark = pytest.mark.integration


async def test_soak_100_cycles_loses_nothing_and_does_not_grow(app, model_dir):
    report = await soak(
        app.base_url,
        app.name,
        app.save_path,
        model_dir / "model.safetensors",
        app.weights_dir,
        cycles=100,
        clients=8,
        update_every=10,
        first_step=1000,
    )
    print(report.model_dump_json(indent=1))
    assert report.requests_failed == 0, report.failures
    assert report.requests_ok > 100
    assert report.incomplete_manifests == []
    assert report.updates == 10
    warm, end = report.stats["warm"], report.stats["end"]
    assert warm.processes == end.processes == 3  # 2 rollout replicas + the ingress
    # After warm-up, descriptors and threads stay put.
    assert end.fds <= warm.fds + 30, report.stats
    assert end.threads <= warm.threads + 20, report.stats
    # Memory: the export backlog bound keeps unexported recordings from piling up (without it
    # this run grew by ~1.2 GB). A slow growth of ~0.6 MB per profiled step per replica is
    # still open (docs/operations.md, "Soak"); this bound catches anything faster.
    assert end.rss_mb - warm.rss_mb <= 3.0 * 100 * 2, report.stats
