"""An engine without a model, for benchmarks only: it emits tokens at a configured rate with
response lengths from a configured distribution, so scheduling, balance and fault handling can
be measured at scales this machine cannot run with real models."""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlmesh.errors import FailedPrecondition, InvalidArgument
from rlmesh.settings.rollout import SyntheticConfig
from services.rollout.engine import (
    Chunk,
    ChunkStream,
    Engine,
    EngineRequest,
    Finish,
    ParameterSpec,
    UpdateMode,
    check_pin,
    model_parameter_specs,
    validate_request,
)

_POOL_TOKENS = 65_536


def response_length(config: SyntheticConfig, seed: int, max_tokens: int) -> int:
    """The length a request's response will have, the same on every instance for a given seed."""
    rng = random.Random(seed)
    if config.length == "fixed":
        length = config.mean_tokens
    elif config.length == "uniform":
        half = config.sigma * config.mean_tokens
        length = rng.uniform(config.mean_tokens - half, config.mean_tokens + half)
    else:
        # Parameterised by its mean: mu = ln(mean) - sigma^2 / 2.
        length = rng.lognormvariate(math.log(config.mean_tokens) - config.sigma**2 / 2, config.sigma)
    return max(1, min(max_tokens, round(length)))


def model_vocab_size(model_dir: str | Path) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir).get_text_config().vocab_size


def _seed_of(request: EngineRequest, fallback: random.Random) -> int:
    if request.sampling.seed:
        return request.sampling.seed
    digest = hashlib.blake2b(repr((request.prompt_token_ids, fallback.random())).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclass(slots=True)
class _Sequence:
    request: EngineRequest
    stream: ChunkStream
    target: int
    """Response tokens still to emit."""
    rng: random.Random
    reason: Finish
    """How the response ends: LENGTH when the drawn length hit max_tokens, else STOP."""
    pending: Chunk = field(init=False)
    done: bool = False

    def __post_init__(self) -> None:
        self.pending = Chunk(self.request.request_id)

    def take(self, finish: Finish = Finish.NONE) -> Chunk:
        self.pending.finish = finish
        self.done = finish is not Finish.NONE
        chunk, self.pending = self.pending, Chunk(self.request.request_id)
        return chunk

    @property
    def pinned(self) -> bool:
        return self.request.pinned_version is not None and not self.done


class SyntheticEngine(Engine):
    """Its tokens depend on no weights: `pause` holds generation like any engine, while
    `abort-continue` has no KV cache to recompute and behaves as `continue` (no prefill time charged).
    A commit waits for the pinned requests to end, and a hold takes effect only then."""

    def __init__(
        self,
        config: SyntheticConfig,
        max_batch_size: int = 256,
        model_dir: str | Path | None = None,
        weight_version: int = 0,
        update_mode: UpdateMode = "continue",
    ) -> None:
        super().__init__(max_batch_size, weight_version, update_mode)
        self.config = config
        self._staged: int | None = None
        self._specs = model_parameter_specs(model_dir) if model_dir else []
        self.vocab_size = min(config.vocab_size, model_vocab_size(model_dir)) if model_dir else config.vocab_size
        """Token ids stay below it: a trainer of the model embeds them."""
        self._waiting: list[_Sequence] = []
        self._running: dict[str, _Sequence] = {}
        self._progress = 0.0
        self._rng = random.Random(0)
        pool = random.Random(1)
        self._token_pool = [pool.randrange(self.vocab_size) for _ in range(_POOL_TOKENS)]
        self._logprob_pool = [-pool.expovariate(1.0) for _ in range(_POOL_TOKENS)]
        self._wake = asyncio.Event()
        self._pinned_ended = asyncio.Event()
        """Set whenever a request ends: a commit waiting for pinned ones looks again."""
        self._task: asyncio.Task[None] | None = None
        self._requests_seen = 0

    @property
    def running_requests(self) -> int:
        return len(self._running) + len(self._waiting)

    def parameter_specs(self) -> list[ParameterSpec]:
        return self._specs

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        self.abort()
        if self._task:
            self._task.cancel()

    async def generate(self, request: EngineRequest) -> AsyncIterator[Chunk]:
        validate_request(request, self.vocab_size, 2**31)
        if request.sampling.stop:
            raise InvalidArgument(
                f"request {request.request_id}: the synthetic engine's tokens are no text: stop strings cannot be "
                "matched (use stop_token_ids)"
            )
        self._requests_seen += 1
        if self.config.fail_after_requests is not None and self._requests_seen > self.config.fail_after_requests:
            raise RuntimeError(f"synthetic fault: requests after the first {self.config.fail_after_requests} fail")
        request_id = request.request_id
        if request_id in self._running or any(s.request.request_id == request_id for s in self._waiting):
            raise InvalidArgument(f"request {request_id} is already running")
        check_pin(request, self._version, (self._staged is not None or self._held) and not self._pinned_live())
        seed = _seed_of(request, self._rng)
        total = response_length(self.config, seed, request.sampling.max_tokens)
        target = max(0, total - len(request.continued_token_ids))
        reason = Finish.LENGTH if total >= request.sampling.max_tokens else Finish.STOP
        rng = random.Random(seed + len(request.continued_token_ids))
        sequence = _Sequence(request, ChunkStream(asyncio.get_running_loop()), target, rng, reason)
        if target == 0:
            # The continued tokens already reach the length this seed gives: the response ends here.
            sequence.stream.put(sequence.take(reason))
        else:
            self._waiting.append(sequence)
            self._wake.set()
        try:
            async for chunk in sequence.stream.chunks():
                yield chunk
        finally:
            if not sequence.done:
                self.abort([request_id])

    def abort(self, request_ids: list[str] | None = None) -> int:
        sequences = list(self._running.values()) + self._waiting
        targets = [s for s in sequences if request_ids is None or s.request.request_id in request_ids]
        for sequence in targets:
            self._running.pop(sequence.request.request_id, None)
            if sequence in self._waiting:
                self._waiting.remove(sequence)
            sequence.stream.put(sequence.take(Finish.ABORT))
        if targets:
            self._pinned_ended.set()
        return len(targets)

    async def pause(self) -> None:
        self._paused = True

    async def resume(self) -> None:
        self._paused = False
        self._wake.set()

    async def hold_for_update(self) -> None:
        self._held = True

    async def release_update_hold(self) -> None:
        self._held = False
        self._wake.set()

    def stage_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        if version <= self._version:
            raise FailedPrecondition(f"version {version} is not newer than the served version {self._version}")
        self._staged = version

    async def commit_staged(self, version: int) -> None:
        if self._staged != version:
            raise FailedPrecondition(f"version {version} is not staged (staged: {self._staged})")
        while self._pinned_live():
            self._pinned_ended.clear()
            await self._pinned_ended.wait()
        self._version, self._staged = version, None

    def _pinned_live(self) -> bool:
        return any(s.pinned for s in self._running.values()) or any(s.pinned for s in self._waiting)

    def _halted(self) -> bool:
        # A hold waits for the pinned requests: the switch it is for waits for them.
        return self._paused or (self._held and not self._pinned_live())

    def _step_seconds(self) -> float:
        busy = max(1, len(self._running))
        return max(self.config.min_step_seconds, busy / self.config.throughput_tokens_per_second) / self.config.speed

    async def _run(self) -> None:
        last = time.perf_counter()
        while True:
            if not (self._running or self._waiting) or self._halted():
                self._wake.clear()
                await self._wake.wait()
                last = time.perf_counter()
                self._progress = 0.0
                continue
            await asyncio.sleep(self.config.tick_seconds)
            # A pause or hold that came during the tick stops this step too.
            if self._halted():
                continue
            self._admit()
            now = time.perf_counter()
            # Steps completed since the last tick, at the step time of the current batch size.
            self._progress += (now - last) / self._step_seconds()
            last = now
            steps = int(self._progress)
            self._progress -= steps
            if steps:
                self._advance(steps)

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self._max_batch:
            sequence = self._waiting.pop(0)
            self._running[sequence.request.request_id] = sequence

    def _advance(self, steps: int) -> None:
        interval = self.config.stream_interval
        pool = len(self._token_pool)
        for request_id, sequence in list(self._running.items()):
            count = min(steps, sequence.target)
            # Slices of a fixed random pool, at a per-request offset: cheap enough that the
            # engine never limits what it is used to measure.
            start = sequence.rng.randrange(pool - count) if count < pool else 0
            sequence.pending.token_ids += self._token_pool[start : start + count]
            sequence.pending.logprobs += self._logprob_pool[start : start + count]
            sequence.pending.weight_versions += [self._version] * count
            sequence.target -= count
            self._generated += count
            if sequence.target == 0:
                del self._running[request_id]
                sequence.stream.put(sequence.take(sequence.reason))
                self._pinned_ended.set()
            elif len(sequence.pending.token_ids) >= interval:
                sequence.stream.put(sequence.take())
