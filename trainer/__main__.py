"""`python -m trainer --config config/trainer.yaml [key.path=value ...]`: the main job."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from profiling.analysis.verify import VerifyReport, verify_steps
from profiling.backends.torch_profiler import init_kineto, quiet_kineto_env
from profiling.cli import print_verify_report
from profiling.manifest import StepManifest
from profiling.schedule import StepSchedule
from profiling.store import TraceStore
from profiling.weight_source import WeightSource
from trainer.client import AppAddress, RolloutError
from trainer.config import ConfigError, TrainerConfig, load_config
from trainer.finish_hook import run_finish_hook
from trainer.launch import RankDied, launch_ranks
from trainer.loop import RunResult, VersionStats, run_training
from trainer.report import finish_steps, profile_table, wait_for_manifests

if TYPE_CHECKING:
    from trainer.in_cluster import AppCluster  # imports Ray: only object-store jobs load it

log = logging.getLogger("trainer")
cli = typer.Typer(add_completion=False, help=__doc__)
console = Console()


@cli.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def main(
    ctx: typer.Context,
    config: Annotated[Path, typer.Option(help="Trainer config (YAML).")] = Path("config/trainer.yaml"),
) -> None:
    """Run the fully-async RL loop with profiled weight syncs; extra KEY.PATH=VALUE override config keys."""
    logging.basicConfig(level=logging.WARNING)
    _quiet_native_logs()
    try:
        cfg = load_config(config, ctx.args)
        for note in cfg.notes():  # accepted keys that do nothing here: said once, never silently
            log.warning(note)
        result, manifests, report = asyncio.run(_run(cfg))
    except (ConfigError, RolloutError, ValueError, RankDied) as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(1) from None
    console.print(
        f"reward {result.first_reward:.3f} (first fifth of versions) -> {result.last_reward:.3f} (last fifth); "
        f"{result.dropped_stale} stale samples dropped"
    )
    verified = None
    if manifests:
        store = TraceStore(cfg.global_profiler.save_path)
        console.print(profile_table(manifests))
        console.print(f"traces under {store.root}")
        verified = _verify(store, [k for k, m in manifests.items() if m is not None])
    if (hook := cfg.finish_hook()) is not None and any(m is not None for m in manifests.values()):
        run_finish_hook(hook, lambda line: console.print(line, markup=False, highlight=False, soft_wrap=True))
    if report is not None:
        index, merge_errors = report
        console.print(f"report: {index}", soft_wrap=True)  # one line, for scripts
        for message in merge_errors:
            console.print(f"[red]error:[/red] {message}")
        if merge_errors:
            raise typer.Exit(1)
    if any(m is None or m.status != "complete" for m in manifests.values()):
        console.print("[red]error:[/red] some profiled steps are not complete (see the table)")
        raise typer.Exit(1)
    if verified is not None and not verified.ok:
        console.print(
            "[red]error:[/red] the recorded steps do not verify (see the violations above; "
            "`python -m profiling verify <save_path>` repeats the check)"
        )
        raise typer.Exit(1)


def _verify(store: TraceStore, steps: list[int]) -> VerifyReport:
    """Check the steps recorded (docs/analysis.md#verify) and print the violations, if any, and
    the one-line verdict."""
    report = verify_steps(store, steps)
    print_verify_report(console, report, notes=False)
    return report


def _quiet_native_logs() -> None:
    """Keep torch.profiler's native lines that look like failures out of the job's output (on the
    main thread, before anything profiles): Kineto's USDT probe lines (QUIET_KINETO_ENV, which
    the local cluster passes on to Ray's processes), and its thread-check ERROR, by initialising
    Kineto here, on the thread that imported torch, instead of at the first start on the model
    thread (init_kineto)."""
    quiet_kineto_env()
    init_kineto()


async def _run(
    cfg: TrainerConfig,
) -> tuple[RunResult, dict[int, StepManifest | None], tuple[Path, list[str]] | None]:
    """Train, then wait for every profiled step's traces while the app is still up (a background
    merge in the app must not be cut off), merge them and write the reports."""
    with contextlib.ExitStack() as stack:
        model_dir = cfg.trainer.model_path
        address: AppAddress
        cluster: AppCluster | None = None
        if cfg.rollout.url is not None:
            address = AppAddress(
                url=cfg.rollout.url, control_url=cfg.rollout.control_url, control_token=cfg.rollout.control_token
            )
        else:
            from trainer.local_app import local_rollout_app

            console.print("starting a local Ray + rollout app ...")
            app = stack.enter_context(
                local_rollout_app(
                    cfg.rollout.serve_config,
                    {
                        "save_path": cfg.global_profiler.save_path,
                        "weights_dir": cfg.trainer.weights_dir,
                        **({"model_path": model_dir} if model_dir else {}),
                    },
                )
            )
            address, model_dir = app.address, app.model_dir
            if cfg.trainer.weight_transfer == WeightSource.OBJECT_STORE:
                from trainer.in_cluster import AppCluster

                cluster = AppCluster(address=app.ray_address, app_name=app.name)
        if model_dir is None:
            raise ConfigError("trainer.model_path is required with rollout.url (the app's initial weights)")
        progress = Progress(
            TextColumn("[bold]versions"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("reward {task.fields[reward]:.3f}"),
            TextColumn("{task.fields[rate]:.1f} samples/s"),
            TextColumn("staleness {task.fields[staleness]:.2f}"),
            TimeElapsedColumn(),
            console=console,
        )
        task = progress.add_task("train", total=cfg.trainer.total_versions, reward=0.0, rate=0.0, staleness=0.0)

        def on_version(s: VersionStats) -> None:
            progress.update(task, advance=1, reward=s.reward, rate=s.samples_per_s, staleness=s.staleness)

        with progress:
            if cfg.trainer.launches_ranks:
                result = await asyncio.to_thread(launch_ranks, cfg, address, model_dir, on_version, cluster=cluster)
            else:
                async with address.client() as client:
                    result = await run_training(cfg, client, model_dir, on_version, cluster=cluster)
        manifests, report = {}, None
        if cfg.global_profiler.profiles:
            store = TraceStore(cfg.global_profiler.save_path)
            reached = cfg.trainer.total_versions + 1  # step k+1 starts at the sync publishing k
            labels = [w[0] for w in StepSchedule.from_config(cfg.global_profiler).windows if w[0] <= reached]
            manifests = await asyncio.to_thread(wait_for_manifests, store, labels, cfg.profile_export_timeout_s)
            recorded = [k for k, m in manifests.items() if m is not None]
            if recorded:
                console.print("merging traces and writing reports ...")
                report = await asyncio.to_thread(finish_steps, store, recorded, cfg.global_profiler.merge_on_complete)
        return result, manifests, report
    raise AssertionError("unreachable")


if __name__ == "__main__":
    cli()
