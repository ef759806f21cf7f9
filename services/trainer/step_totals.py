"""A training step's figures as its micro-batches come in, and the metrics filed for it. A step
may end with no group to train on (dynamic sampling dropped every one and a task ran out of
prompts to draw in their place): it is reported as such, with no figure of the groups it lacks."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlmesh.manager.v1 import manager_pb2
from rlmesh.rewards.base import RewardResult
from services.trainer.pipeline import ScoredGroup
from services.trainer.ranks.critic import CriticSums
from services.trainer.ranks.policy import MicroBatchStats
from services.trainer.trajectories import STATUS_NAMES, EpisodeFigures, turn_reward_means
from services.trainer.validation import SOLVED

TOKEN_FIGURES = ("kl", "clip_fraction", "importance_weight_mean", "capped_fraction", "behaviour_kl")
"""Per-token figures of a micro-batch (MicroBatchStats), averaged over a step's response tokens."""


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


@dataclass(slots=True)
class TaskTotals:
    rewards: list[float] = field(default_factory=list)
    components: dict[str, list[float]] = field(default_factory=dict)
    failures: int = 0

    def add(self, result: RewardResult) -> None:
        self.rewards.append(result.reward)
        self.failures += result.failed
        for name, value in result.components.items():
            self.components.setdefault(name, []).append(value)

    def metrics(self, prefix: str) -> dict[str, float]:
        values = {f"{prefix}reward": mean(self.rewards), f"{prefix}reward_failures": float(self.failures)}
        values.update({f"{prefix}{name}": mean(v) for name, v in self.components.items()})
        return values


@dataclass(slots=True)
class StepTotals:
    rewards: list[float] = field(default_factory=list)
    per_task: dict[str, TaskTotals] = field(default_factory=dict)
    staleness: list[int] = field(default_factory=list)
    response_tokens: int = 0
    wait_seconds: float = 0.0
    """Time spent waiting for the next micro-batch of rollouts."""
    mini_batch_losses: list[float] = field(default_factory=list)
    _loss_sum: float = 0.0
    _loss_count: int = 0
    tokens: int = 0
    token_weighted: dict[str, float] = field(default_factory=dict)
    """Token-weighted sums of the micro-batches' per-token figures (TOKEN_FIGURES)."""
    importance_weight_max: float = 0.0
    grad_norm: list[float] = field(default_factory=list)
    dropped_groups: int = 0
    trained_groups: int = 0
    critic: CriticSums | None = None
    """The critic's sums over the step's micro-batches (advantage_estimator `gae`)."""
    episodes: list[EpisodeFigures] = field(default_factory=list)
    """Multi-turn episodes of the groups trained, the masked ones too."""

    def add_micro_batch(self, stats: MicroBatchStats) -> None:
        self._loss_sum += stats.loss * stats.loss_count
        self._loss_count += stats.loss_count
        self.tokens += stats.tokens
        for name in TOKEN_FIGURES:
            self.token_weighted[name] = self.token_weighted.get(name, 0.0) + getattr(stats, name) * stats.tokens
        self.importance_weight_max = max(self.importance_weight_max, stats.importance_weight_max)
        if stats.critic is not None:
            self.critic = stats.critic if self.critic is None else self.critic + stats.critic

    def end_mini_batch(self) -> None:
        self.mini_batch_losses.append(self._loss_sum / max(self._loss_count, 1))
        self._loss_sum, self._loss_count = 0.0, 0

    def figures(self) -> dict[str, float]:
        """The loss's figures; none for a step that trained on nothing."""
        if not self.mini_batch_losses:
            return {}
        values = {name: total / max(self.tokens, 1) for name, total in self.token_weighted.items()}
        values["loss"] = mean(self.mini_batch_losses)
        values["importance_weight_max"] = self.importance_weight_max
        values["grad_norm"] = mean(self.grad_norm)
        if self.critic is not None:
            values.update(self.critic.metrics())
        return values

    def add(self, group: ScoredGroup, policy_version: int) -> None:
        """A group being trained on at `policy_version`."""
        self.trained_groups += 1
        task_totals = self.per_task.setdefault(group.record.task, TaskTotals())
        for result in group.results:
            task_totals.add(result)
            self.rewards.append(result.reward)
        for sample, versions in zip(group.samples, group.weight_versions):
            self.staleness.append(policy_version - min(versions))
            self.response_tokens += len(sample.response_ids)
        self.episodes += group.episodes

    def metrics(self, max_staleness: int, step_seconds: float) -> dict[str, float]:
        """What is filed for the step; the groups' figures only if it trained on any."""
        values = {
            "trained_groups": float(self.trained_groups),
            "dropped_groups": float(self.dropped_groups),
            "step_seconds": step_seconds,
            "generated_tokens_per_second": self.response_tokens / step_seconds,
            "rollout_wait_seconds": self.wait_seconds,
        }
        if not self.rewards:
            return values
        values |= {
            "reward": mean(self.rewards),
            "exact_match": mean([float(r >= SOLVED) for r in self.rewards]),
            "reward_failures": float(sum(t.failures for t in self.per_task.values())),
            **self.figures(),
            "staleness_mean": mean(self.staleness),
            "staleness_max": float(max(self.staleness)),
            "staleness_violations": float(sum(s > max_staleness for s in self.staleness)),
            "response_length": self.response_tokens / len(self.rewards),
        }
        for name, task_totals in self.per_task.items():
            values.update(task_totals.metrics(f"task/{name}/"))
        return values | episode_metrics(self.episodes)


def balance_metrics(balance: manager_pb2.StageBalance) -> dict[str, float]:
    """The manager's balance estimate between training and rollout, as a step's metrics."""
    return {
        "balance/recommended_rollout_instances": float(balance.recommended_rollout_instances),
        "balance/offload_fraction": balance.offload_fraction,
        "balance/local_window_seconds": balance.local_window_seconds,
        "balance/rollout_seconds": balance.rollout_seconds,
        "balance/train_seconds": balance.train_seconds,
    }


def episode_metrics(episodes: list[EpisodeFigures]) -> dict[str, float]:
    """Turns per episode, environment seconds, tokens by source, and episodes by how they ended."""
    if not episodes:
        return {}
    values = {
        "episodes/count": float(len(episodes)),
        "episodes/turns": mean([float(e.turns) for e in episodes]),
        "episodes/environment_seconds": mean([e.environment_seconds for e in episodes]),
        "episodes/broken_histories": float(sum(e.parts > 1 for e in episodes)),
    }
    for source in ("model", "environment", "template"):
        values[f"episodes/tokens/{source}"] = mean([float(e.tokens.get(source, 0)) for e in episodes])
    for status in STATUS_NAMES.values():
        values[f"episodes/ended/{status}"] = float(sum(e.status == status for e in episodes))
    for cause in sorted({cause for e in episodes for cause in e.breaks}):
        values[f"gateway/breaks/{cause}"] = float(sum(e.breaks.get(cause, 0) for e in episodes))
    return values | turn_reward_means(episodes, "episodes/")
