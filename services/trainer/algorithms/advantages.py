"""Advantage estimators, registered by name. An outcome estimator turns the rewards of the groups
trained together (a micro-batch's, one tensor per group, of any size from 1: masking can leave one
sample) into one advantage per sample; a critic estimator (`gae`) turns per-token rewards and a
value model's values into per-token advantages and returns. Pure tensor functions, computed in
float64: rewards a few ulps apart in float32 would otherwise lose their centring."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.trainer.algorithms.registry import Registry

EPSILON = 1e-6
"""A spread of rewards at or below this teaches nothing: its advantages are 0."""

OutcomeEstimator = Callable[[list[torch.Tensor]], list[torch.Tensor]]
CriticEstimator = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, float], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class AdvantageEstimator:
    compute: OutcomeEstimator | CriticEstimator
    needs_critic: bool
    """A critic estimator: (token rewards, values, mask, gamma, lambda) -> (advantages, returns),
    each [sequences, tokens]; otherwise groups' rewards -> groups' advantages."""


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def outcome_estimator(name: str) -> Callable[[OutcomeEstimator], OutcomeEstimator]:
    def add(compute: OutcomeEstimator) -> OutcomeEstimator:
        ADVANTAGE_ESTIMATORS.register(name)(AdvantageEstimator(compute, needs_critic=False))
        return compute

    return add


def critic_estimator(name: str) -> Callable[[CriticEstimator], CriticEstimator]:
    def add(compute: CriticEstimator) -> CriticEstimator:
        ADVANTAGE_ESTIMATORS.register(name)(AdvantageEstimator(compute, needs_critic=True))
        return compute

    return add


def group_advantages(rewards: torch.Tensor, eps: float = EPSILON) -> torch.Tensor:
    """(r - mean) / std within each group (rows); a group with equal rewards teaches nothing: 0."""
    values = rewards.double()
    mean = values.mean(dim=-1, keepdim=True)
    std = values.std(dim=-1, keepdim=True, unbiased=False)
    return torch.where(std > eps, (values - mean) / (std + eps), torch.zeros_like(values)).to(rewards.dtype)


@outcome_estimator("grpo")
def grpo(groups: list[torch.Tensor]) -> list[torch.Tensor]:
    """GRPO: each group's rewards centred on the group's mean and scaled by its standard deviation."""
    return [group_advantages(rewards[None])[0] for rewards in groups]


@outcome_estimator("rloo")
def rloo(groups: list[torch.Tensor]) -> list[torch.Tensor]:
    """REINFORCE leave-one-out: a sample's reward less the mean reward of the other samples of its
    group, r_i - (sum_j r_j - r_i) / (n - 1) = n / (n - 1) (r_i - mean). A sample alone in its
    group has no other to compare with: 0."""
    advantages = []
    for rewards in groups:
        values = rewards.double()
        if len(values) < 2:
            advantages.append(torch.zeros_like(rewards))
            continue
        others = (values.sum() - values) / (len(values) - 1)
        advantages.append((values - others).to(rewards.dtype))
    return advantages


@outcome_estimator("reinforce_pp")
def reinforce_pp(groups: list[torch.Tensor]) -> list[torch.Tensor]:
    """REINFORCE++ with a baseline: each reward less its group's mean, then the whole batch's
    centred rewards normalised by their mean and standard deviation (one scale for every group,
    where GRPO scales each group by its own)."""
    centred = [rewards.double() - rewards.double().mean() for rewards in groups]
    batch = torch.cat(centred)
    mean, std = batch.mean(), batch.std(unbiased=False)
    if std <= EPSILON:
        return [torch.zeros_like(rewards) for rewards in groups]
    return [((values - mean) / (std + EPSILON)).to(rewards.dtype) for values, rewards in zip(centred, groups)]


@critic_estimator("gae")
def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each sequence's response tokens (where `mask` is 1):
    delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}, the state after the
    last response token terminal (V = 0); returns are A + V. All [sequences, tokens], 0 off the mask."""
    mask = mask.double()
    rewards, values = rewards.double() * mask, values.double() * mask
    advantages = torch.zeros_like(values)
    following = torch.zeros_like(values[:, 0])
    next_values = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        following = delta + gamma * lam * following
        advantages[:, t] = following
        next_values = values[:, t]
    advantages = advantages * mask
    return advantages, advantages + values
