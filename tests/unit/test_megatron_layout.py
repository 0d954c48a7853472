"""The Megatron backend's config (trainer.backend, trainer.megatron; docs/trainer.md#megatron) and
the pipeline figures summarize and the report show (profiling/analysis: the bubble of each stage)."""

from __future__ import annotations

import pytest

from profiling.analysis.breakdown import step_breakdown
from profiling.analysis.summary import PIPELINE_P2P, covered_ms
from profiling.manifest import ManifestEntry, ParallelRank
from trainer.config import ConfigError, load_config

MEGATRON = "config/trainer.megatron.yaml"


def test_the_shipped_config_is_tensor_parallel_2_and_launches_ranks():
    cfg = load_config(MEGATRON)
    assert cfg.trainer.backend == "megatron" and cfg.trainer.megatron.tensor_parallel_size == 2
    assert cfg.trainer.launches_ranks
    one = load_config(MEGATRON, ["trainer.world_size=1", "trainer.megatron.tensor_parallel_size=1"])
    assert one.trainer.launches_ranks, "megatron's groups need a process group even for one rank"
    assert not load_config(None).trainer.launches_ranks


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.world_size=3"], "trainer.world_size 3 is not a multiple of"),
        (
            ["trainer.megatron.micro_batch_size=3"],
            "does not split into 1 data-parallel share(s) of whole micro-batches",
        ),
        (
            ["trainer.world_size=4", "trainer.mini_batch_size=6"],
            "make it a multiple of 4",
        ),
    ],
)
def test_a_layout_that_does_not_fit_is_refused_naming_the_keys(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(MEGATRON, overrides)
    assert message in str(e.value)


def test_a_megatron_layout_under_the_fsdp_backend_is_a_note_not_silence():
    cfg = load_config(None, ["trainer.megatron.tensor_parallel_size=2"])
    assert any("trainer.megatron is set but trainer.backend is 'fsdp'" in n for n in cfg.notes())


def test_coordinates_are_checked_and_named():
    grid = ParallelRank(tp=1, pp=0, dp=0, tp_size=2, pp_size=1, dp_size=1)
    entry = ManifestEntry(role="trainer", rank=1, parallel=grid)
    assert entry.trainer_name == "trainer tp1 pp0 (rank 1)"
    assert ManifestEntry(role="trainer", rank=1).trainer_name == "trainer rank 1"
    with pytest.raises(ValueError, match="pp rank 2 is not below pp_size 2"):
        ParallelRank(tp=0, pp=2, dp=0, tp_size=1, pp_size=2, dp_size=1)


def test_the_bubble_is_p2p_time_inside_the_mini_batches_only():
    forward = [(0.0, 1000.0), (5000.0, 1000.0)]  # µs
    p2p = [(100.0, 200.0), (250.0, 100.0), (900.0, 300.0), (3000.0, 500.0)]
    # 100-350 overlapping (250 µs), 900-1000 inside (100 µs); 3000-3500 is between mini-batches.
    assert covered_ms(p2p, forward) == pytest.approx(0.35)
    assert PIPELINE_P2P.fullmatch("gloo:recv") and PIPELINE_P2P.fullmatch("nccl:send")
    assert not PIPELINE_P2P.fullmatch("gloo:all_reduce"), "tensor-parallel collectives are not the bubble"


def test_each_stage_has_its_training_compute_and_bubble():
    entries = [
        ManifestEntry(role="trainer", rank=r, parallel=ParallelRank(tp=0, pp=r, dp=0, tp_size=1, pp_size=2, dp_size=1))
        for r in (0, 1)
    ]
    b = step_breakdown(
        entries, {"trainer/rank_0": 100.0, "trainer/rank_1": 80.0}, {"trainer/rank_0": 25.0, "trainer/rank_1": 8.0}
    )
    assert [(s.stage, s.ranks, s.training_s, s.bubble_s, s.compute_s, s.bubble_share) for s in b.pipeline] == [
        (0, [0], 0.1, 0.025, 0.075, 0.25),
        (1, [1], 0.08, 0.008, 0.072, 0.1),
    ]
    assert [t.name for t in b.trainer] == ["trainer tp0 pp0 (rank 0)", "trainer tp0 pp1 (rank 1)"]
    assert step_breakdown([ManifestEntry(role="trainer", rank=0)], {}).pipeline == []
