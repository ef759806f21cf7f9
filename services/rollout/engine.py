"""The engine contract every rollout backend implements: the torch engine (CPU default), the
vLLM engine and the synthetic engine (benchmarks) sit behind it."""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

import torch

from rlmesh.errors import Aborted, InvalidArgument

if TYPE_CHECKING:
    from services.rollout.torch.rank import RankHandle


UpdateMode = Literal["continue", "pause", "abort-continue"]
"""What requests in flight do when a new weight version arrives:
- continue: they go on decoding while it loads and continue on it after the switch, their KV cache
  kept (computed by the old version);
- pause: no decode step runs from the moment the push begins until it is committed (or failed, or
  abandoned); then they continue on the new version, their KV cache kept (verl, slime);
- abort-continue: at the switch their KV cache is recomputed under the new version from the prompt
  and the tokens so far, and they continue from there (SkyRL).
In every mode each token records the version that produced it, and a request stays one stream.
A pinned request (EngineRequest.pinned_version) is never continued or recomputed under another
version in any mode: the switch waits until every pinned request ended, and in pause mode the hold
lets them run to their end (the requests beside them decode on too, on the served version)."""


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
    stop: tuple[str, ...] = ()
    """Stop strings: the response ends at the token with which its text first contains one
    (rlmesh/chat/stop_strings.py)."""


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    continued_token_ids: list[int] = field(default_factory=list)
    """Response tokens generated earlier (elsewhere): generation continues after them and
    `sampling.max_tokens` counts them."""
    pinned_version: int | None = None
    """Every token must come from exactly this weight version (an exact-version batch, held-out
    evaluation); None: any version."""
    background: bool = False
    """Background work: decoded at the lowest CPU priority while nothing else shares the batch
    (engines that can; see GenerateRequest.background)."""
    cache_key: str = ""
    """Requests of one key continue one another (a session's turns): see GenerateRequest.cache_key."""

    @property
    def remaining_tokens(self) -> int:
        return self.sampling.max_tokens - len(self.continued_token_ids)


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


class WeightLayout(Enum):
    """Which tensors a weight push carries."""

    FULL = 1
    """Full tensors under the model's HF names; the engine slices them itself."""
    TENSOR_PARALLEL = 2
    """One payload per tensor-parallel rank with only that rank's shards (fused qkv and gate_up,
    padded vocabulary), received by the rank itself."""


@dataclass(frozen=True, slots=True)
class ParameterSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


class Engine(abc.ABC):
    """An inference engine serving one weight version at a time.

    Weight updates are two-phase: `stage_weights` loads a new version into a standby copy
    while generation goes on; `commit_staged` switches to it between two decode steps, so no
    token is ever produced by a partially loaded model. `update_mode` says what requests in
    flight do meanwhile (see UpdateMode); in pause mode the weight updater brackets the push
    with `hold_for_update` and `release_update_hold`."""

    weight_layout: ClassVar[WeightLayout] = WeightLayout.FULL
    quantized_weights: ClassVar[bool] = False
    """Serves quantized weights, so lossy link compression is acceptable."""

    def __init__(self, max_batch_size: int, weight_version: int, update_mode: UpdateMode = "continue") -> None:
        self._max_batch = max_batch_size
        self._version = weight_version
        self._generated = 0
        self._paused = False
        self._held = False
        self.update_mode: UpdateMode = update_mode
        self.on_failure: Callable[[str], None] | None = None
        """Called (from any thread) once the engine can no longer serve; the process then leaves."""

    @property
    def tensor_parallel_size(self) -> int:
        return 1

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def max_batch_size(self) -> int:
        return self._max_batch

    @property
    def generated_tokens(self) -> int:
        """Tokens generated since start."""
        return self._generated

    @property
    def paused(self) -> bool:
        """Paused by `pause` (PauseGeneration or a drain); a hold for a weight update does not count."""
        return self._paused

    @property
    def held_for_update(self) -> bool:
        return self._held

    @property
    @abc.abstractmethod
    def running_requests(self) -> int: ...

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
    async def pause(self) -> None:
        """Stops decoding after the current step; running requests keep their state."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Continues every paused request where it stopped."""

    @abc.abstractmethod
    async def hold_for_update(self) -> None:
        """Like `pause`, for a weight update (pause mode): returns once the current decode step
        ended; requests keep their state and new ones queue. Independent of `pause`: the hold's
        release does not resume an engine someone paused."""

    @abc.abstractmethod
    async def release_update_hold(self) -> None:
        """Ends the hold; decoding goes on unless the engine is paused."""

    @abc.abstractmethod
    def stage_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Loads a version into the standby copy (blocking; call it off the event loop)."""

    @abc.abstractmethod
    async def commit_staged(self, version: int) -> None:
        """Serves the staged version from the next decode step on (the first after every pinned
        request ended); returns once switched. Cancelled before the switch began, it is withdrawn
        and the version stays staged."""

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def stop(self) -> None: ...


class TensorParallelEngine(Engine):
    """An engine whose tensor-parallel ranks each receive and load their own payload: a version
    is staged once every rank loaded it into its standby copy."""

    weight_layout = WeightLayout.TENSOR_PARALLEL

    @property
    @abc.abstractmethod
    def ranks(self) -> Sequence[RankHandle]:
        """Each rank's receiving end of weight pushes, in rank order."""

    @abc.abstractmethod
    def rank_parameter_specs(self) -> list[ParameterSpec]:
        """The tensors of one rank's payload (the same names and shapes on every rank)."""

    @abc.abstractmethod
    def mark_staged(self, version: int) -> None:
        """Every rank loaded `version` into its standby copy: it may be committed."""


def validate_request(request: EngineRequest, vocab_size: int, max_positions: int) -> None:
    """The checks every engine makes before accepting a request."""
    prompt, sampling, name = request.prompt_token_ids, request.sampling, f"request {request.request_id}"
    if not prompt:
        raise InvalidArgument(f"{name}: prompt_token_ids is empty")
    bad = [t for t in prompt + request.continued_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"{name}: token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    if request.remaining_tokens < 1:
        raise InvalidArgument(
            f"{name}: max_tokens ({sampling.max_tokens}) leaves nothing to generate after "
            f"{len(request.continued_token_ids)} continued tokens"
        )
    if len(prompt) + sampling.max_tokens > max_positions:
        raise InvalidArgument(
            f"{name}: prompt ({len(prompt)}) + max_tokens ({sampling.max_tokens}) "
            f"exceeds the model's {max_positions} positions"
        )
    if sampling.temperature < 0:
        raise InvalidArgument(f"{name}: temperature must be >= 0")
    if not 0 < sampling.top_p <= 1:
        raise InvalidArgument(f"{name}: top_p must be in (0, 1]")
    if request.pinned_version is not None and request.pinned_version < 0:
        raise InvalidArgument(f"{name}: pinned_version must be >= 0, got {request.pinned_version}")


def check_pin(request: EngineRequest, served: int, moving_on: bool) -> None:
    """Refuses a pinned request the engine cannot run entirely on its version: it serves another,
    or a newer one is staged or held for (`moving_on`: admitting the request would start holding
    that switch back; engines pass False while pinned requests of the version already hold it, so
    a validation's requests all join the one hold). The refusal is ABORTED, so the manager takes
    the request to an instance still serving the version."""
    pinned = request.pinned_version
    if pinned is None:
        return
    if pinned != served:
        raise Aborted(
            f"request {request.request_id} is pinned to weight version {pinned}; this instance serves version {served}"
        )
    if moving_on:
        raise Aborted(
            f"request {request.request_id} is pinned to weight version {pinned}; "
            "this instance is switching to a newer version"
        )


class ChunkStream:
    """Carries one request's chunks from the thread or task that decodes to the consumer; tokens
    decoded while the consumer was busy leave as one chunk, not one each."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._queue: asyncio.Queue[Chunk] = asyncio.Queue()

    def put(self, chunk: Chunk) -> None:
        """From the event loop's thread."""
        self._queue.put_nowait(chunk)

    async def chunks(self) -> AsyncIterator[Chunk]:
        while True:
            chunk = await self._queue.get()
            while chunk.finish is Finish.NONE and not self._queue.empty():
                chunk = merge_chunks(chunk, self._queue.get_nowait())
            yield chunk
            if chunk.finish is not Finish.NONE:
                return


def merge_chunks(first: Chunk, second: Chunk) -> Chunk:
    return Chunk(
        request_id=first.request_id,
        token_ids=first.token_ids + second.token_ids,
        logprobs=first.logprobs + second.logprobs,
        weight_versions=first.weight_versions + second.weight_versions,
        finish=second.finish,
    )


def model_parameter_specs(model_dir: str | Path) -> list[ParameterSpec]:
    """The parameters a weight version of this model carries, as the trainer sends them; built on
    the meta device, so nothing is allocated."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return [ParameterSpec(name, tuple(param.shape), param.dtype) for name, param in model.named_parameters()]
