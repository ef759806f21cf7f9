"""The task interface: where prompts come from (a dataset or a generator, with a cursor a checkpoint
saves), how they are rendered for the model, and how a finished sample is scored."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Message = Mapping[str, str]
"""A chat message: {"role": ..., "content": ...}."""


@dataclass(frozen=True, slots=True)
class TaskPrompt:
    """One prompt: chat messages or plain text, and the metadata its reward needs (for example the
    ground truth). Multi-turn environments will extend a prompt with the turns so far; a single-turn
    task is the case of one turn."""

    uid: str
    """Stable within the task (dataset row or generator position): the ledger's key."""
    messages: Sequence[Message] | None = None
    text: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.text is None):
            raise ValueError(f"prompt {self.uid!r}: give either messages or text")


class PromptSource(ABC):
    """An endless, reproducible sequence of training prompts and a fixed held-out set.

    The prompt at each position is a function of the source's seed and the position alone, so
    `cursor` (prompts taken so far) is all a checkpoint needs to resume where the run stopped."""

    cursor: int = 0

    @abstractmethod
    def prompt_at(self, position: int) -> TaskPrompt:
        """The training prompt at `position` (0, 1, ...). Raises `SourceExhausted` past the end."""

    @abstractmethod
    def held_out(self, count: int) -> list[TaskPrompt]:
        """Up to `count` evaluation prompts, never among the training prompts."""

    def take(self, count: int) -> list[TaskPrompt]:
        prompts = [self.prompt_at(self.cursor + i) for i in range(count)]
        self.cursor += count
        return prompts


class SourceExhausted(RuntimeError):
    """A dataset ran out of rows after its configured epochs."""
