"""The default engine: a HF causal LM on CPU with a KV cache and batched sampling, run on a
dedicated thread so the gRPC event loop stays responsive while it decodes."""

from __future__ import annotations

import asyncio
import copy
import threading
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch

from rlmesh.errors import FailedPrecondition, InvalidArgument
from rlmesh.models.loading import copy_into, load_causal_lm
from services.rollout.engine import Chunk, Engine, EngineRequest, Finish, ParameterSpec

log = structlog.get_logger()


@dataclass(slots=True)
class _Running:
    request: EngineRequest
    loop: asyncio.AbstractEventLoop
    chunks: asyncio.Queue[Chunk]
    generator: torch.Generator
    generated: int = 0
    finish: Finish = Finish.NONE
    pending: Chunk = field(init=False)

    def __post_init__(self) -> None:
        self.pending = Chunk(self.request.request_id)

    def emit(self, finish: Finish = Finish.NONE) -> None:
        self.finish = finish
        self.pending.finish = finish
        chunk, self.pending = self.pending, Chunk(self.request.request_id)
        self.loop.call_soon_threadsafe(self.chunks.put_nowait, chunk)


@dataclass(slots=True)
class _Swap:
    version: int
    done: asyncio.Future[None]
    loop: asyncio.AbstractEventLoop


class TorchEngine(Engine):
    """Static batches: requests waiting when a batch starts run together with one KV cache;
    weights switch between decode steps."""

    def __init__(self, model_dir: str | Path, max_batch_size: int = 256, seed: int = 0, weight_version: int = 0) -> None:
        self._active = load_causal_lm(model_dir)
        self._standby = copy.deepcopy(self._active)
        config = self._active.config
        self._vocab_size = int(config.vocab_size)
        self._max_positions = int(config.max_position_embeddings)
        self._pad_id = int(config.pad_token_id if config.pad_token_id is not None else config.eos_token_id)
        self._max_batch = max_batch_size
        self._version = weight_version
        self._staged_version: int | None = None
        self._seeds = torch.Generator().manual_seed(seed)
        self._cond = threading.Condition()
        self._waiting: deque[_Running] = deque()
        self._running: dict[str, _Running] = {}
        self._aborted: set[str] = set()
        self._swap: _Swap | None = None
        self._staging = threading.Lock()
        self._stopped = False
        self._generated = 0
        self._thread = threading.Thread(target=self._loop, name="torch-engine", daemon=True)

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def max_batch_size(self) -> int:
        return self._max_batch

    @property
    def running_requests(self) -> int:
        return len(self._running) + len(self._waiting)

    @property
    def generated_tokens(self) -> int:
        return self._generated

    def parameter_specs(self) -> list[ParameterSpec]:
        return [ParameterSpec(n, tuple(p.shape), p.dtype) for n, p in self._active.named_parameters()]

    async def start(self) -> None:
        self._thread.start()

    async def stop(self) -> None:
        self.abort()
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        await asyncio.to_thread(self._thread.join)

    def _validate(self, request: EngineRequest) -> None:
        prompt = request.prompt_token_ids
        sampling = request.sampling
        if not prompt:
            raise InvalidArgument(f"request {request.request_id}: prompt_token_ids is empty")
        bad = [t for t in prompt if not 0 <= t < self._vocab_size]
        if bad:
            raise InvalidArgument(f"request {request.request_id}: token ids {bad[:5]} outside the vocabulary [0, {self._vocab_size})")
        if sampling.max_tokens < 1:
            raise InvalidArgument(f"request {request.request_id}: max_tokens must be at least 1")
        if len(prompt) + sampling.max_tokens > self._max_positions:
            raise InvalidArgument(
                f"request {request.request_id}: prompt ({len(prompt)}) + max_tokens ({sampling.max_tokens}) "
                f"exceeds the model's {self._max_positions} positions"
            )
        if sampling.temperature < 0:
            raise InvalidArgument(f"request {request.request_id}: temperature must be >= 0")
        if not 0 < sampling.top_p <= 1:
            raise InvalidArgument(f"request {request.request_id}: top_p must be in (0, 1]")

    async def generate(self, request: EngineRequest) -> AsyncIterator[Chunk]:
        self._validate(request)
        seed = request.sampling.seed or int(torch.randint(1, 2**62, (1,), generator=self._seeds))
        state = _Running(request, asyncio.get_running_loop(), asyncio.Queue(), torch.Generator().manual_seed(seed))
        with self._cond:
            if self._stopped:
                raise FailedPrecondition("engine is stopping")
            running = self._running.get(request.request_id)
            if (running and running.finish is Finish.NONE) or any(
                w.request.request_id == request.request_id for w in self._waiting
            ):
                raise InvalidArgument(f"request {request.request_id} is already running")
            self._aborted.discard(request.request_id)
            self._waiting.append(state)
            self._cond.notify_all()
        try:
            while True:
                chunk = await state.chunks.get()
                # Tokens decoded while the consumer was busy leave as one chunk, not one each.
                while chunk.finish is Finish.NONE and not state.chunks.empty():
                    chunk = _merge(chunk, state.chunks.get_nowait())
                yield chunk
                if chunk.finish is not Finish.NONE:
                    return
        finally:
            if state.finish is Finish.NONE:
                self.abort([request.request_id])

    def abort(self, request_ids: list[str] | None = None) -> int:
        with self._cond:
            known = [i for i, s in self._running.items() if s.finish is Finish.NONE]
            known += [w.request.request_id for w in self._waiting]
            targets = set(known) if request_ids is None else set(request_ids) & set(known)
            for state in [w for w in self._waiting if w.request.request_id in targets]:
                self._waiting.remove(state)
                state.emit(Finish.ABORT)
            self._aborted |= targets & self._running.keys()
            return len(targets)

    def stage_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        if not self._staging.acquire(blocking=False):
            raise FailedPrecondition("another version is being staged")
        try:
            with self._cond:
                if version <= self._version:
                    raise FailedPrecondition(f"version {version} is not newer than the served version {self._version}")
                if self._swap is not None:
                    raise FailedPrecondition("a weight switch is already pending")
                self._staged_version = None
            try:
                copy_into(self._standby, tensors)
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from exc
            with self._cond:
                self._staged_version = version
        finally:
            self._staging.release()

    async def commit_staged(self, version: int) -> None:
        loop = asyncio.get_running_loop()
        with self._cond:
            if self._staged_version != version:
                raise FailedPrecondition(f"version {version} is not staged (staged: {self._staged_version})")
            swap = _Swap(version, loop.create_future(), loop)
            self._swap = swap
            self._cond.notify_all()
        await swap.done

    def _apply_swap(self) -> None:
        with self._cond:
            swap, self._swap = self._swap, None
            if swap is None:
                return
            self._active, self._standby = self._standby, self._active
            self._version = swap.version
            self._staged_version = None
        swap.loop.call_soon_threadsafe(lambda: swap.done.done() or swap.done.set_result(None))
        log.info("weights switched", weight_version=swap.version)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and self._swap is None and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                batch = [self._waiting.popleft() for _ in range(min(self._max_batch, len(self._waiting)))]
                for state in batch:
                    self._running[state.request.request_id] = state
            self._apply_swap()
            if batch:
                try:
                    with torch.inference_mode():
                        self._run_batch(batch)
                except Exception:
                    log.exception("batch failed")
                    for state in batch:
                        if state.finish is Finish.NONE:
                            state.emit(Finish.ABORT)
                finally:
                    with self._cond:
                        for state in batch:
                            # A finished request's id may already run again in a newer state.
                            if self._running.get(state.request.request_id) is state:
                                del self._running[state.request.request_id]
                                self._aborted.discard(state.request.request_id)

    def _run_batch(self, batch: list[_Running]) -> None:
        prompts = [s.request.prompt_token_ids for s in batch]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self._pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        temperatures = torch.tensor([s.request.sampling.temperature for s in batch])
        out = self._active(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        logits_version = self._version
        cache = out.past_key_values
        next_position = positions[:, -1] + 1
        while True:
            tokens = self._sample(batch, out.logits[:, -1].float(), temperatures, logits_version)
            with self._cond:
                aborted = set(self._aborted)
            for state in batch:
                if state.finish is Finish.NONE and state.request.request_id in aborted:
                    state.emit(Finish.ABORT)
            if all(s.finish is not Finish.NONE for s in batch):
                return
            self._apply_swap()
            mask = torch.cat([mask, torch.ones(len(batch), 1, dtype=mask.dtype)], dim=1)
            out = self._active(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=next_position[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            logits_version = self._version
            cache = out.past_key_values
            next_position = next_position + 1

    def _sample(self, batch: list[_Running], logits: torch.Tensor, temperatures: torch.Tensor, version: int) -> torch.Tensor:
        scaled = logits / torch.where(temperatures > 0, temperatures, 1.0)[:, None]
        logprobs = torch.log_softmax(scaled, dim=-1)
        tokens = torch.full((len(batch),), self._pad_id, dtype=torch.long)
        for row, state in enumerate(batch):
            if state.finish is not Finish.NONE:
                continue
            sampling = state.request.sampling
            if sampling.temperature == 0:
                token = int(torch.argmax(logprobs[row]))
            else:
                probs = logprobs[row].exp()
                if sampling.top_p < 1:
                    probs = _nucleus(probs, sampling.top_p)
                token = int(torch.multinomial(probs, 1, generator=state.generator))
            tokens[row] = token
            state.generated += 1
            self._generated += 1
            state.pending.token_ids.append(token)
            state.pending.logprobs.append(float(logprobs[row, token]))
            state.pending.weight_versions.append(version)
            if token in sampling.stop_token_ids:
                state.emit(Finish.STOP)
            elif state.generated >= sampling.max_tokens:
                state.emit(Finish.LENGTH)
            else:
                state.emit()
        return tokens


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keeps the smallest set of most likely tokens whose mass reaches top_p."""
    sorted_probs, order = probs.sort(descending=True)
    keep = sorted_probs.cumsum(0) - sorted_probs < top_p
    filtered = torch.zeros_like(probs)
    filtered[order[keep]] = sorted_probs[keep]
    return filtered / filtered.sum()


def _merge(first: Chunk, second: Chunk) -> Chunk:
    return Chunk(
        request_id=first.request_id,
        token_ids=first.token_ids + second.token_ids,
        logprobs=first.logprobs + second.logprobs,
        weight_versions=first.weight_versions + second.weight_versions,
        finish=second.finish,
    )
