"""A micro-batch's advantages from its groups' rewards: the configured outcome estimator over the groups
trained together, a trajectory's advantage on each of its samples, and per-turn credit where a
multi-turn task asks for it."""

from __future__ import annotations

import torch

from services.trainer.algorithms import ADVANTAGE_ESTIMATORS
from services.trainer.pipeline import ScoredGroup
from services.trainer.ranks.batching import TrainingSample
from services.trainer.trajectories import turn_credit


def with_advantages(micro_batch: list[ScoredGroup], estimator_name: str) -> list[TrainingSample]:
    """The micro-batch's samples, each with its advantage (a critic estimator's come from the value
    model, in the ranks: the samples are returned as they are)."""
    samples = [sample for group in micro_batch for sample in group.samples]
    estimator = ADVANTAGE_ESTIMATORS.get(estimator_name)
    if estimator.needs_critic:
        return samples
    advantages = estimator.compute([torch.tensor(group.rewards, dtype=torch.float64) for group in micro_batch])
    # A trajectory trained as several samples (its history was edited) gives each its advantage.
    for group, group_advantages in zip(micro_batch, advantages):
        for sample, owner in zip(group.samples, group.owners()):
            sample.advantage = float(group_advantages[owner])
    credited = [g for g in micro_batch if g.turn_rewards is not None]
    for group, credit in zip(credited, turn_credit([g.turn_rewards for g in credited], estimator.compute)):
        for sample, owner in zip(group.samples, group.owners()):
            sample.token_advantages = [
                credit[owner].get(turn, 0.0) if turn >= 0 else 0.0 for turn in sample.token_turns
            ]
    return samples
