"""The one rule micro-batches are packed by: the manager's StreamRollouts packs by it for any
reader, and the trainer's pipeline packs by it after scoring (it drops and reorders groups first)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, TypeVar

from rlmesh.manager.v1 import manager_pb2

Group = TypeVar("Group")


class SegmentLike(Protocol):
    """A session segment: the manager's own or the contract's (manager.proto's Segment)."""

    source: int
    token_ids: Sequence[int]
    starts_part: bool
    reused_prefix_tokens: int


def group_tokens(prompt_tokens: int, response_lengths: Iterable[int]) -> int:
    """What a group weighs against a budget: every sample's prompt and response tokens."""
    return sum(prompt_tokens + length for length in response_lengths)


def trajectory_tokens(segments: Iterable[SegmentLike]) -> int:
    """What a multi-turn trajectory weighs against a budget, as the trainer trains it: each part
    of its stream that holds model tokens (one, unless a harness edited the history) is a sample
    of the part's stream up to its last model token, the reused prefix of a part included."""
    total = 0
    length = 0
    """Of the current part's stream."""
    trained_end = 0
    """The current part's stream up to its last model token (0: it has none yet)."""
    for segment in segments:
        if segment.starts_part:
            total += trained_end
            length = min(length, segment.reused_prefix_tokens)
            trained_end = 0
        length += len(segment.token_ids)
        if segment.source == manager_pb2.SEGMENT_SOURCE_MODEL and segment.token_ids:
            trained_end = length
    return total + trained_end


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
