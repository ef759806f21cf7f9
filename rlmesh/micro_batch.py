"""The one rule micro-batches are packed by: the manager's StreamRollouts packs by it for any
reader, and the trainer's pipeline packs by it after scoring (it drops and reorders groups first)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

Group = TypeVar("Group")


def group_tokens(prompt_tokens: int, response_lengths: Iterable[int]) -> int:
    """What a group weighs against a budget: every sample's prompt and response tokens."""
    return sum(prompt_tokens + length for length in response_lengths)


def pack(groups: Sequence[Group], most: int, max_tokens: int, tokens: Callable[[Group], int]) -> list[Group]:
    """The first groups, in order, that make one micro-batch: at most `most` of them within a budget
    of `max_tokens` (0: no budget). Groups are never split, so one over budget travels alone."""
    packed: list[Group] = []
    total = 0
    for group in groups[:most]:
        size = tokens(group)
        if max_tokens and packed and total + size > max_tokens:
            break
        packed.append(group)
        total += size
    return packed
