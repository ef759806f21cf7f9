"""The default engine: a HF causal LM on CPU with continuous batching over one KV cache, run on a
dedicated thread so the gRPC event loop stays responsive while it decodes."""

from __future__ import annotations

import asyncio
import copy
import threading
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from rlmesh.errors import FailedPrecondition, InvalidArgument
from rlmesh.models.loading import copy_into, load_causal_lm
from services.rollout.engine import Chunk, ChunkStream, Engine, EngineRequest, Finish, ParameterSpec, validate_request

log = structlog.get_logger()


@dataclass(slots=True)
class _Sequence:
    request: EngineRequest
    stream: ChunkStream
    generator: torch.Generator | None
    """Own generator only for seeded requests: their tokens then do not depend on batch-mates."""
    generated: int = 0
    finish: Finish = Finish.NONE
    pending: Chunk = field(init=False)

    def __post_init__(self) -> None:
        self.pending = Chunk(self.request.request_id)

    def take_chunk(self, finish: Finish = Finish.NONE) -> Chunk:
        self.finish = finish
        self.pending.finish = finish
        chunk, self.pending = self.pending, Chunk(self.request.request_id)
        return chunk


@dataclass(slots=True)
class _Swap:
    version: int
    done: asyncio.Future[None]
    loop: asyncio.AbstractEventLoop


class _RunningBatch:
    """The sequences being decoded and their KV cache, right-aligned: row i's valid entries are
    the last ones of the cache (mask 1), padding is on the left (mask 0). Sequences join by
    merging their prefill cache and leave by dropping their row, at any decode step."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.rows: list[_Sequence] = []
        self.cache = DynamicCache()
        self.mask = torch.zeros(0, 0, dtype=torch.long)
        self.positions = torch.zeros(0, dtype=torch.long)
        """Position of the token each row feeds next."""
        self.next_tokens = torch.zeros(0, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, rows: list[_Sequence], cache: DynamicCache, mask: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> None:
        if not self.rows:
            self.rows, self.cache, self.mask, self.positions, self.next_tokens = rows, cache, mask, positions, tokens
            return
        width = max(self.mask.shape[1], mask.shape[1])
        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.keys = torch.cat([_left_pad(mine.keys, width, dim=2), _left_pad(theirs.keys, width, dim=2)])
            mine.values = torch.cat([_left_pad(mine.values, width, dim=2), _left_pad(theirs.values, width, dim=2)])
        self.mask = torch.cat([_left_pad(self.mask, width, dim=1), _left_pad(mask, width, dim=1)])
        self.positions = torch.cat([self.positions, positions])
        self.next_tokens = torch.cat([self.next_tokens, tokens])
        self.rows = self.rows + rows

    def drop_finished(self) -> None:
        keep = [i for i, row in enumerate(self.rows) if row.finish is Finish.NONE]
        if len(keep) == len(self.rows):
            return
        if not keep:
            self.clear()
            return
        index = torch.tensor(keep)
        self.rows = [self.rows[i] for i in keep]
        self.mask, self.positions, self.next_tokens = self.mask[index], self.positions[index], self.next_tokens[index]
        # Columns that only the departed rows used are dropped too, so the cache shrinks.
        first = int((self.mask.sum(0) > 0).nonzero()[0])
        self.mask = self.mask[:, first:]
        for layer in self.cache.layers:
            layer.keys = layer.keys[index, :, first:]
            layer.values = layer.values[index, :, first:]


def _left_pad(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    pad = [0, 0] * (tensor.dim() - 1 - dim) + [missing, 0]
    return F.pad(tensor, pad)


class TorchEngine(Engine):
    """Continuous batching: at every decode step waiting requests are prefilled and join the
    running batch, and finished or aborted ones leave it; weights switch between two steps."""

    def __init__(self, model_dir: str | Path, max_batch_size: int = 256, seed: int = 0, weight_version: int = 0) -> None:
        super().__init__(max_batch_size, weight_version)
        self._active = load_causal_lm(model_dir)
        self._standby = copy.deepcopy(self._active)
        config = self._active.config
        self._vocab_size = int(config.vocab_size)
        self._max_positions = int(config.max_position_embeddings)
        self._pad_id = int(config.pad_token_id if config.pad_token_id is not None else config.eos_token_id)
        self._staged_version: int | None = None
        self._rng = torch.Generator().manual_seed(seed)
        self._cond = threading.Condition()
        self._waiting: deque[_Sequence] = deque()
        self._batch = _RunningBatch()
        self._aborted: set[str] = set()
        self._swap: _Swap | None = None
        self._paused = False
        self._paused_ack: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._staging = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="torch-engine", daemon=True)

    @property
    def running_requests(self) -> int:
        return len(self._batch) + len(self._waiting)

    def parameter_specs(self) -> list[ParameterSpec]:
        return [ParameterSpec(n, tuple(p.shape), p.dtype) for n, p in self._active.named_parameters()]

    async def start(self) -> None:
        self._thread.start()

    async def stop(self) -> None:
        self.abort()
        with self._cond:
            self._stopped = True
            self._paused = False
            self._cond.notify_all()
        await asyncio.to_thread(self._thread.join)

    async def generate(self, request: EngineRequest) -> AsyncIterator[Chunk]:
        validate_request(request, self._vocab_size, self._max_positions)
        seed = request.sampling.seed
        # A continuation must not replay the random stream of the attempt it continues.
        generator = torch.Generator().manual_seed(seed + len(request.continued_token_ids)) if seed else None
        sequence = _Sequence(request, ChunkStream(asyncio.get_running_loop()), generator)
        request_id = request.request_id
        with self._cond:
            if self._stopped:
                raise FailedPrecondition("engine is stopping")
            if any(s.request.request_id == request_id and s.finish is Finish.NONE for s in self._batch.rows) or any(
                w.request.request_id == request_id for w in self._waiting
            ):
                raise InvalidArgument(f"request {request_id} is already running")
            self._aborted.discard(request_id)
            self._waiting.append(sequence)
            self._cond.notify_all()
        try:
            async for chunk in sequence.stream.chunks():
                yield chunk
        finally:
            if sequence.finish is Finish.NONE:
                self.abort([request_id])

    def abort(self, request_ids: list[str] | None = None) -> int:
        with self._cond:
            running = {s.request.request_id for s in self._batch.rows if s.finish is Finish.NONE}
            waiting = {w.request.request_id for w in self._waiting}
            targets = running | waiting if request_ids is None else set(request_ids) & (running | waiting)
            for sequence in [w for w in self._waiting if w.request.request_id in targets]:
                self._waiting.remove(sequence)
                chunk = sequence.take_chunk(Finish.ABORT)
                sequence.stream.loop.call_soon_threadsafe(sequence.stream.put, chunk)
            self._aborted |= targets & running
            self._cond.notify_all()
            return len(targets)

    async def pause(self) -> None:
        loop = asyncio.get_running_loop()
        acknowledged = loop.create_future()
        with self._cond:
            self._paused = True
            self._paused_ack.append((loop, acknowledged))
            self._cond.notify_all()
        await acknowledged

    async def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

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

    # The decode thread ----------------------------------------------------------------------

    def _has_work(self) -> bool:
        if self._stopped or self._swap is not None or self._aborted:
            return True
        return not self._paused and bool(self._batch.rows or self._waiting)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._acknowledge_pause()
                while not self._has_work():
                    self._cond.wait()
                    self._acknowledge_pause()
                if self._stopped:
                    return
                aborted, self._aborted = self._aborted, set()
                joining: list[_Sequence] = []
                if not self._paused:
                    free = self._max_batch - len(self._batch)
                    joining = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
            self._apply_swap()
            emitted: list[tuple[_Sequence, Chunk]] = []
            try:
                with torch.inference_mode():
                    for sequence in self._batch.rows:
                        if sequence.request.request_id in aborted and sequence.finish is Finish.NONE:
                            emitted.append((sequence, sequence.take_chunk(Finish.ABORT)))
                    self._batch.drop_finished()
                    if joining:
                        self._prefill(joining, emitted)
                    if self._batch.rows and not self._paused:
                        self._decode(emitted)
            except Exception:
                log.exception("decode step failed; its requests end aborted")
                for sequence in self._batch.rows + joining:
                    if sequence.finish is Finish.NONE:
                        emitted.append((sequence, sequence.take_chunk(Finish.ABORT)))
                self._batch.clear()
            self._batch.drop_finished()
            _deliver(emitted)

    def _acknowledge_pause(self) -> None:
        if self._paused or self._stopped:
            for loop, future in self._paused_ack:
                loop.call_soon_threadsafe(lambda f=future: f.done() or f.set_result(None))
            self._paused_ack.clear()

    def _prefill(self, joining: list[_Sequence], emitted: list[tuple[_Sequence, Chunk]]) -> None:
        inputs = [s.request.prompt_token_ids + s.request.continued_token_ids for s in joining]
        width = max(len(ids) for ids in inputs)
        ids = torch.tensor([[self._pad_id] * (width - len(x)) + x for x in inputs])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in inputs])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self._active(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        tokens = self._sample(joining, out.logits[:, -1].float(), self._version, emitted)
        self._batch.join(joining, out.past_key_values, mask, positions[:, -1] + 1, tokens)

    def _decode(self, emitted: list[tuple[_Sequence, Chunk]]) -> None:
        batch = self._batch
        batch.mask = torch.cat([batch.mask, torch.ones(len(batch), 1, dtype=batch.mask.dtype)], dim=1)
        out = self._active(
            input_ids=batch.next_tokens[:, None],
            attention_mask=batch.mask,
            position_ids=batch.positions[:, None],
            past_key_values=batch.cache,
            use_cache=True,
        )
        batch.cache = out.past_key_values
        batch.positions = batch.positions + 1
        batch.next_tokens = self._sample(batch.rows, out.logits[:, -1].float(), self._version, emitted)

    def _sample(self, rows: list[_Sequence], logits: torch.Tensor, version: int, emitted: list[tuple[_Sequence, Chunk]]) -> torch.Tensor:
        """Samples one token per row, vectorised except for seeded rows; the logprob is taken
        under the temperature-scaled distribution before top-p truncation."""
        temperatures = torch.tensor([s.request.sampling.temperature for s in rows])
        top_p = torch.tensor([s.request.sampling.top_p for s in rows])
        logprobs = torch.log_softmax(logits / torch.where(temperatures > 0, temperatures, 1.0)[:, None], dim=-1)
        tokens = logprobs.argmax(-1)
        sampled = (temperatures > 0).nonzero().flatten().tolist()
        if sampled:
            probs = _nucleus(logprobs[sampled].exp(), top_p[sampled])
            shared = [i for i, row in enumerate(sampled) if rows[row].generator is None]
            if shared:
                draws = torch.multinomial(probs[shared], 1, generator=self._rng).flatten()
                tokens[[sampled[i] for i in shared]] = draws
            for i, row in enumerate(sampled):
                if rows[row].generator is not None:
                    tokens[row] = torch.multinomial(probs[i], 1, generator=rows[row].generator)
        chosen = logprobs.gather(1, tokens[:, None]).flatten().tolist()
        for sequence, token, logprob in zip(rows, tokens.tolist(), chosen):
            if sequence.finish is not Finish.NONE:
                continue
            sequence.generated += 1
            self._generated += 1
            sequence.pending.token_ids.append(token)
            sequence.pending.logprobs.append(logprob)
            sequence.pending.weight_versions.append(version)
            if token in sequence.request.sampling.stop_token_ids:
                emitted.append((sequence, sequence.take_chunk(Finish.STOP)))
            elif sequence.generated >= sequence.request.remaining_tokens:
                emitted.append((sequence, sequence.take_chunk(Finish.LENGTH)))
            else:
                emitted.append((sequence, sequence.take_chunk()))
        return tokens


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, keeps the smallest set of most likely tokens whose mass reaches top_p."""
    if bool((top_p >= 1).all()):
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p[:, None]
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    filtered = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return filtered / filtered.sum(-1, keepdim=True)


def _deliver(emitted: list[tuple[_Sequence, Chunk]]) -> None:
    """One wake-up per event loop per decode step, however many requests got tokens."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[ChunkStream, Chunk]]] = defaultdict(list)
    for sequence, chunk in emitted:
        by_loop[sequence.stream.loop].append((sequence.stream, chunk))
    for loop, items in by_loop.items():
        loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[ChunkStream, Chunk]]) -> None:
    for stream, chunk in items:
        stream.put(chunk)
