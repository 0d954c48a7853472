"""Test support: the reward verl's fully-async test run scores its rollouts with
(`reward.custom_reward_function`, verl's own hook): 1 when the answer holds the ground truth."""

from __future__ import annotations

from typing import Any


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    return float(ground_truth in solution_str)
