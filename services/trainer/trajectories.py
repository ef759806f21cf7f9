"""A multi-turn session's trajectory as training samples: each part of its token stream (one, unless a
harness edited the history) is a sample whose loss covers the model's tokens only, with their
behaviour logprobs and versions; plus the episode's figures (turns, environment time, tokens by source)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rlmesh.manager.v1 import manager_pb2

MODEL = manager_pb2.SEGMENT_SOURCE_MODEL
SOURCE_NAMES = {
    MODEL: "model",
    manager_pb2.SEGMENT_SOURCE_ENVIRONMENT: "environment",
    manager_pb2.SEGMENT_SOURCE_TEMPLATE: "template",
}
STATUS_NAMES = {
    manager_pb2.SESSION_STATUS_DONE: "done",
    manager_pb2.SESSION_STATUS_TRUNCATED_CONTEXT: "truncated_context",
    manager_pb2.SESSION_STATUS_TRUNCATED_TURNS: "truncated_turns",
    manager_pb2.SESSION_STATUS_DEADLINE: "deadline",
    manager_pb2.SESSION_STATUS_ENVIRONMENT_ERROR: "environment_error",
}
MASKED_STATUSES = frozenset({manager_pb2.SESSION_STATUS_DEADLINE, manager_pb2.SESSION_STATUS_ENVIRONMENT_ERROR})
"""Trajectories that end this way are left out of their group: an environment's failure is not the policy's."""


@dataclass(slots=True)
class Part:
    """One part of a trajectory as a sample: the context before its first model token, then the rest
    up to its last model token, masked to the model's tokens."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    """Per response token: the behaviour logprob of a model token, 0 elsewhere."""
    mask: list[float]
    """Per response token: 1 for the model's, 0 for environment and template tokens."""
    weight_versions: list[int]
    """The versions of its model tokens."""
    turns: list[int]
    """Per response token, the turn of a model token (-1 for context)."""


@dataclass(slots=True)
class EpisodeFigures:
    status: str
    turns: int
    environment_seconds: float
    tokens: dict[str, int] = field(default_factory=dict)
    """By source: model, environment, template."""
    parts: int = 1
    turn_rewards: dict[int, float] = field(default_factory=dict)
    breaks: dict[str, int] = field(default_factory=dict)
    """Parts started after the first, by the cause of their break ("unnamed" when none was named)."""


def trajectory_reward(trajectory: manager_pb2.SessionTrajectory) -> float:
    """The final reward when one was set, else the sum of the turns' rewards (0 without any)."""
    if trajectory.HasField("reward"):
        return trajectory.reward
    return float(sum(trajectory.turn_rewards.values()))


def parts_of(trajectory: manager_pb2.SessionTrajectory) -> list[Part]:
    """The trajectory's parts that hold model tokens, in order. A part that starts at a break reuses
    a prefix of the previous part's stream as context: its model tokens there are not trained again."""
    # Per token: (token, logprob, version, turn), the turn -1 for context.
    streams: list[list[tuple[int, float, int, int]]] = [[]]
    for segment in trajectory.segments:
        if segment.starts_part:
            kept = [(token, 0.0, version, -1) for token, _, version, _ in streams[-1][: segment.reused_prefix_tokens]]
            streams.append(kept)
        if segment.source == MODEL:
            streams[-1] += zip(
                segment.token_ids, segment.logprobs, segment.weight_versions, [segment.turn] * len(segment.token_ids)
            )
        else:
            streams[-1] += [(token, 0.0, -1, -1) for token in segment.token_ids]
    parts = []
    for stream in streams:
        trained = [i for i, (_, _, _, turn) in enumerate(stream) if turn >= 0]
        if not trained:
            continue
        first, last = trained[0], trained[-1]
        tail = stream[first : last + 1]
        parts.append(
            Part(
                [t for t, _, _, _ in stream[:first]],
                [t for t, _, _, _ in tail],
                [lp for _, lp, _, _ in tail],
                [1.0 if turn >= 0 else 0.0 for _, _, _, turn in tail],
                [v for _, _, v, turn in tail if turn >= 0],
                [turn for _, _, _, turn in tail],
            )
        )
    return parts


def transcript_ids(trajectory: manager_pb2.SessionTrajectory) -> list[int]:
    """The trajectory's model output as its reward sees it, in training and in held-out evaluation:
    every part's tokens from its first model token to its last, in order (within a part, what
    answered the model's turns too; never the prompt or a history the harness re-rendered)."""
    return [token for part in parts_of(trajectory) for token in part.response_ids]


def turn_credit(
    groups_turn_rewards: list[list[dict[int, float]]], estimator: Callable[[list[torch.Tensor]], list[torch.Tensor]]
) -> list[list[dict[int, float]]]:
    """Per-turn credit: for each turn index, the estimator's advantages over the group's rewards of
    that turn (a trajectory without a reward for it counts 0 there); per group, per trajectory, by turn."""
    turns = sorted({turn for group in groups_turn_rewards for rewards in group for turn in rewards})
    credit: list[list[dict[int, float]]] = [[{} for _ in group] for group in groups_turn_rewards]
    for turn in turns:
        advantages = estimator(
            [
                torch.tensor([rewards.get(turn, 0.0) for rewards in group], dtype=torch.float64)
                for group in groups_turn_rewards
            ]
        )
        for group_credit, group_advantages in zip(credit, advantages):
            for trajectory, advantage in zip(group_credit, group_advantages.tolist()):
                trajectory[turn] = advantage
    return credit


def figures_of(trajectory: manager_pb2.SessionTrajectory) -> EpisodeFigures:
    tokens = {name: 0 for name in SOURCE_NAMES.values()}
    for segment in trajectory.segments:
        tokens[SOURCE_NAMES.get(segment.source, "template")] += len(segment.token_ids)
    breaks: dict[str, int] = {}
    for segment in trajectory.segments:
        if segment.starts_part:
            breaks[segment.break_cause or "unnamed"] = breaks.get(segment.break_cause or "unnamed", 0) + 1
    return EpisodeFigures(
        STATUS_NAMES.get(trajectory.status, "open"),
        trajectory.turns,
        trajectory.environment_seconds,
        tokens,
        1 + sum(breaks.values()),
        dict(trajectory.turn_rewards),
        breaks,
    )


def turn_reward_means(episodes: list[EpisodeFigures], prefix: str) -> dict[str, float]:
    """Per turn index, the mean reward of the episodes that rewarded that turn (`<prefix>turn<k>_reward`)."""
    by_turn: dict[int, list[float]] = {}
    for episode in episodes:
        for turn, reward in episode.turn_rewards.items():
            by_turn.setdefault(turn, []).append(reward)
    return {f"{prefix}turn{turn}_reward": sum(r) / len(r) for turn, r in sorted(by_turn.items())}
