"""Reward shapers, registered by name: each adds a term to a sample's reward, filed as a reward
component of its own name. A shaper whose settings turn it off returns None and adds nothing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.trainer.algorithms.registry import Registry


@dataclass(frozen=True, slots=True)
class ShapingInput:
    response_length: int
    """Response tokens."""
    max_tokens: int
    """The task's response budget."""


RewardShaper = Callable[[ShapingInput, Any], float | None]
"""(the sample, the algorithm's settings) -> the term added to its reward, or None."""
REWARD_SHAPERS: Registry[RewardShaper] = Registry("reward shaper")


def overlong_penalty(response_length: int, max_tokens: int, buffer_tokens: int, penalty: float) -> float:
    """DAPO's soft overlong punishment, added to a sample's reward: 0 up to
    `max_tokens - buffer_tokens` tokens, then falling linearly to `-penalty` at `max_tokens` (and
    staying there). `buffer_tokens == 0` turns it off."""
    if not 0 <= buffer_tokens <= max_tokens:
        raise ValueError(f"buffer_tokens must be in [0, max_tokens = {max_tokens}], got {buffer_tokens}")
    if buffer_tokens == 0:
        return 0.0
    excess = response_length - (max_tokens - buffer_tokens)
    if excess <= 0:
        return 0.0
    return -penalty * min(excess, buffer_tokens) / buffer_tokens


@REWARD_SHAPERS.register("overlong_penalty")
def overlong(sample: ShapingInput, settings: Any) -> float | None:
    """`overlong_penalty` with the settings' overlong_buffer_tokens and overlong_penalty; off at 0 buffer tokens."""
    if not settings.overlong_buffer_tokens:
        return None
    return overlong_penalty(
        sample.response_length, sample.max_tokens, settings.overlong_buffer_tokens, settings.overlong_penalty
    )


def shape(sample: ShapingInput, settings: Any) -> dict[str, float]:
    """Every registered shaper's term for the sample, by name (those turned off left out)."""
    terms = {name: shaper(sample, settings) for name, shaper in REWARD_SHAPERS.items()}
    return {name: term for name, term in terms.items() if term is not None}
