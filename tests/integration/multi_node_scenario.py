"""The multi-node scenario of test_multi_node.py, run in its own process (it needs its own Ray
cluster, not the test session's): a 2-node cluster on one machine (ray.cluster_utils.Cluster),
one replica per node, each node with its own trace directory, traces collected through Ray to
the one save_path, and weights published by an in-cluster trainer through the object store.

    python tests/integration/multi_node_scenario.py WORKDIR MODEL_DIR   # prints a JSON report
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from profiling.schedule import StepSchedule  # noqa: E402
from serve_app.app import build_app  # noqa: E402
from serve_app.net import free_port  # noqa: E402
from trainer.client import RolloutClient, RolloutError  # noqa: E402
from trainer.in_cluster import InClusterWeights  # noqa: E402
from trainer.profiled_sync import InClusterPublisher, ProfiledWeightSync  # noqa: E402

APP = "multinode"
NODE_ARGS = {"num_cpus": 2, "object_store_memory": 200 * 2**20, "include_dashboard": False}


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


async def generate_until_every_replica_recorded(http: httpx.AsyncClient, client: RolloutClient) -> dict:
    """Completions until both replicas counted forward steps in the active session."""
    deadline = time.monotonic() + 120
    while True:
        await asyncio.gather(
            *(http.post("/v1/completions", json={"prompt": f"one two {i}", "max_tokens": 6}) for i in range(8))
        )
        status = await client.status()
        if len(status.replicas) == 2 and all(r.forward_steps > 0 for r in status.replicas):
            return status.model_dump()
        if time.monotonic() > deadline:
            raise RuntimeError(f"replicas did not all record: {status}")


async def wait_complete(client: RolloutClient, step: int) -> dict:
    deadline = time.monotonic() + 180
    while True:
        m = await client.step(step)
        if m.status in ("complete", "partial") or time.monotonic() > deadline:
            return m.model_dump(mode="json")
        await asyncio.sleep(0.5)


async def scenario(url: str, work: Path, model_dir: Path) -> dict:
    report: dict = {}
    base = load_file(str(model_dir / "model.safetensors"))
    async with RolloutClient(url) as client, httpx.AsyncClient(base_url=url, timeout=60) as http:
        # The trainer runs in this Ray cluster: weights go through the object store.
        sync = ProfiledWeightSync(
            StepSchedule(steps=[1, 2]), client, save_path=None, publisher=InClusterPublisher(InClusterWeights(APP))
        )
        await sync.begin()  # starts step 1
        report["status_step1"] = await generate_until_every_replica_recorded(http, client)
        new = {k: v + 0.01 for k, v in base.items()}
        await sync.sync(1, lambda: _ready(new))  # stop 1 -> update (object store) -> start 2
        report["status_step2"] = await generate_until_every_replica_recorded(http, client)
        await sync.end()  # stop 2
        report["manifests"] = {k: await wait_complete(client, k) for k in (1, 2)}
        report["refused"] = {}
        for name, version, state in (("bad_tensors", 2, {"bogus": torch.zeros(3)}), ("older_version", 0, new)):
            try:
                await InClusterWeights(APP).update_weights(version, state)
                report["refused"][name] = None
            except RolloutError as e:
                report["refused"][name] = {"status": e.status, "detail": e.detail}
        # A replica restarted after the update loads version 1 from the object store too.
        before = await client.status()
        victim = before.replicas[0]
        os.kill(victim.pid, signal.SIGKILL)  # a replica this scenario's app started
        deadline = time.monotonic() + 180
        while True:
            await asyncio.sleep(1)
            now = (await client.status()).replicas
            if len(now) == 2 and all(r.ok for r in now) and victim.pid not in {r.pid for r in now}:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the killed replica did not come back: {now}")
        report["restarted"] = {"old": victim.replica_id, "versions": [r.weight_version for r in now]}
        report["completion_versions"] = sorted(
            {
                c["weight_version"]
                for r in await asyncio.gather(
                    *(http.post("/v1/completions", json={"prompt": "red green", "max_tokens": 4}) for _ in range(6))
                )
                for c in r.json()["choices"]
            }
        )
        report["final_status"] = (await client.status()).model_dump()
    return report


async def _ready(value):
    return value


def main(work: Path, model_dir: Path) -> None:
    cluster = Cluster(initialize_head=True, head_node_args=NODE_ARGS)
    cluster.add_node(**{k: v for k, v in NODE_ARGS.items() if k != "include_dashboard"})
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        args = {
            "num_replicas": 2,
            "max_replicas_per_node": 1,
            "replica_num_cpus": 0.5,
            "trace_collection": "ray",
            "node_dir": str(work / "node"),
            "save_path": str(work / "traces"),
            "weights_dir": str(work / "weights"),
            "model_path": str(model_dir),
            "min_free_disk_mb": 1,
            "control_timeout_s": 30.0,
            "merge_on_complete": False,
        }
        serve.run(build_app(args), name=APP, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        report = asyncio.run(scenario(url, work, model_dir))
        report["nodes"] = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        report["collector_node"] = ray.get(
            ray.get_actor(f"rollout-profiler-trace-collector-{APP}", namespace="serve").node_id.remote()
        )
        report["save_path_files"] = files_under(work / "traces")
        report["node_dir_files"] = files_under(work / "node")
        serve.delete(APP)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
