"""What every reward function takes and returns, and the interface they share (built-in, a user's
Python callable, a remote verifier)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class RewardItem:
    """One finished sample to score."""

    sample_id: str
    """The trainer's id of the sample, unique within the run."""
    prompt: str
    """The rendered prompt text the policy saw."""
    completion: str
    """The decoded response (special tokens removed)."""
    metadata: Mapping[str, Any]
    """The prompt's metadata from its task (for example the ground truth under `answer`)."""
    completion_token_ids: Sequence[int] = ()
    """The response's token ids as generated, its final stop token included if it produced one:
    per-token rewards are one per id here."""


@dataclass(frozen=True, slots=True)
class RewardResult:
    """A sample's score: a scalar reward, named components and optionally one reward per token."""

    reward: float
    """The scalar the trainer optimises; it must be finite."""
    components: Mapping[str, float] = field(default_factory=dict)
    """Named parts of the reward (e.g. `exact`, `format`), logged as `task/<name>/<component>`; they need
    not add up to `reward`."""
    token_rewards: Sequence[float] | None = None
    """One reward per completion token id, for token-level credit; None gives only the scalar."""
    error: str = ""
    """Non-empty when the sample could not be scored; `reward` is then the task's failure reward."""

    @property
    def failed(self) -> bool:
        """The sample could not be scored (`error` says why)."""
        return bool(self.error)


class RewardFunction(Protocol):
    """Scores a batch of samples; one result per item, in order. May raise: the caller guards it."""

    async def score(self, items: Sequence[RewardItem]) -> list[RewardResult]:
        """One result per item, in the items' order."""
        ...

    async def close(self) -> None:
        """Releases what the function holds (a channel to a remote verifier); called once, at the end."""
        ...


def as_result(value: Any) -> RewardResult:
    """A user's return value as a RewardResult: a number, a RewardResult, or a mapping with `reward`
    and optionally `components` and `token_rewards`. Raises TypeError or ValueError otherwise."""
    if isinstance(value, RewardResult):
        result = value
    elif isinstance(value, bool) or isinstance(value, (int, float)):
        result = RewardResult(float(value))
    elif isinstance(value, Mapping):
        if "reward" not in value:
            raise ValueError(f"a reward mapping needs a 'reward' key, got keys {sorted(value)}")
        unknown = set(value) - {"reward", "components", "token_rewards"}
        if unknown:
            raise ValueError(
                f"unknown keys in a reward mapping: {sorted(unknown)} (known: reward, components, token_rewards)"
            )
        components = {str(k): float(v) for k, v in dict(value.get("components") or {}).items()}
        token_rewards = value.get("token_rewards")
        result = RewardResult(
            float(value["reward"]), components, [float(t) for t in token_rewards] if token_rewards is not None else None
        )
    else:
        raise TypeError(f"a reward must be a number or a mapping with 'reward', got {type(value).__name__}")
    if not math.isfinite(result.reward):
        raise ValueError(f"reward is {result.reward}")
    return result
