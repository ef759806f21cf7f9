"""The engine contract every rollout backend implements (torch on CPU today; vLLM and a
synthetic engine behind the same interface later)."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from enum import Enum

import torch


class Finish(Enum):
    """Why a response ended; NONE while it is still running."""

    NONE = 0
    STOP = 1
    LENGTH = 2
    ABORT = 3


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    max_tokens: int = 16
    stop_token_ids: frozenset[int] = frozenset()
    seed: int = 0
    """0 lets the engine choose."""


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    """Prompt, followed by tokens already generated elsewhere when this is a continuation."""
    sampling: Sampling


@dataclass(slots=True)
class Chunk:
    """Tokens of one request since its previous chunk, each with its logprob (temperature-scaled
    distribution, before top-p truncation, as the trainer computes it) and the weight version
    that produced it."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    finish: Finish = Finish.NONE


@dataclass(frozen=True, slots=True)
class ParameterSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


class Engine(abc.ABC):
    """An inference engine serving one weight version at a time.

    Weight updates are two-phase: `stage_weights` loads a new version into a standby copy
    while generation goes on; `commit_staged` switches to it between two decode steps, so no
    token is ever produced by a partially loaded model."""

    @property
    @abc.abstractmethod
    def weight_version(self) -> int: ...

    @property
    @abc.abstractmethod
    def max_batch_size(self) -> int: ...

    @property
    @abc.abstractmethod
    def running_requests(self) -> int: ...

    @property
    @abc.abstractmethod
    def generated_tokens(self) -> int: ...

    @abc.abstractmethod
    def parameter_specs(self) -> list[ParameterSpec]:
        """The tensors a weight version must provide, by name."""

    @abc.abstractmethod
    def generate(self, request: EngineRequest) -> AsyncIterator[Chunk]:
        """Streams the request's tokens; the last chunk has `finish` set."""

    @abc.abstractmethod
    def abort(self, request_ids: list[str] | None = None) -> int:
        """Aborts the named requests (all when None); returns how many were running."""

    @abc.abstractmethod
    def stage_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Loads a version into the standby copy (blocking; call it off the event loop)."""

    @abc.abstractmethod
    async def commit_staged(self, version: int) -> None:
        """Serves the staged version from the next decode step on; returns once switched."""

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def stop(self) -> None: ...
