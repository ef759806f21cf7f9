"""The default engine: a HF causal LM on CPU (split over tensor-parallel ranks: rank 0 here, the
others in worker processes) or on one GPU, with continuous batching over one KV cache, driven by
a dedicated thread so the gRPC event loop stays responsive while it decodes."""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from rlmesh.chat.stop_strings import StopMatcher, tokenizer_decoder
from rlmesh.errors import FailedPrecondition, InvalidArgument
from rlmesh.lifecycle import SessionPriority
from rlmesh.models.families import check_model_dir
from rlmesh.models.loading import serving_config, weights_dtype
from rlmesh.models.tp_layout import ModelShape, hf_parameter_shapes, shard_full_tensors, tp_parameter_shapes
from rlmesh.transfer.payload import name_mismatch
from services.rollout.engine import (
    Chunk,
    ChunkStream,
    EngineRequest,
    Finish,
    ParameterSpec,
    TensorParallelEngine,
    UpdateMode,
    check_pin,
    validate_request,
)
from services.rollout.torch.device import engine_device, serving_dtype
from services.rollout.torch.prefix_cache import PrefixCache
from services.rollout.torch.rank import GRPC_ONLY, RankHandle, RankTransfer
from services.rollout.torch.running import DecodingSequence, RunningBatch
from services.rollout.torch.sampling import draw
from services.rollout.torch.tp_group import TensorParallelGroup

log = structlog.get_logger()


@dataclass(slots=True)
class _Swap:
    version: int
    done: asyncio.Future[None]
    loop: asyncio.AbstractEventLoop
    claimed: bool = False
    """The decode thread is switching: the commit can no longer be withdrawn."""


class TorchEngine(TensorParallelEngine):
    """Continuous batching: at every decode step waiting requests are prefilled and join the
    running batch, and finished or aborted ones leave it; weights switch between two steps.
    Every operation on the model and KV cache goes through the tensor-parallel group's step
    program, so all ranks apply it in the same step; sampling happens here, on rank 0.

    abort-continue recomputes here, at the first step after the switch: the KV cache is cleared
    and every running sequence is prefilled again from its prompt and tokens so far, under the
    new version, then decodes on. Doing it in the engine rather than aborting back to the manager
    keeps each request's stream, its batch slot and its instance: no round trip, no re-dispatch
    that could land elsewhere, and the manager sees one request whatever the weights do.

    A pinned request holds the switch back: the swap is claimed only at a step where no pinned
    request is running or waiting, so none is prefilled, decoded or recomputed on another version.

    On a GPU (`device` cuda) the weights, the KV cache and sampling live on the device; the host
    only builds each step's inputs and reads back one token and logprob per row."""

    def __init__(
        self,
        model_dir: str | Path,
        max_batch_size: int = 256,
        seed: int = 0,
        weight_version: int = 0,
        tensor_parallel_size: int = 1,
        transfer: RankTransfer = GRPC_ONLY,
        threads: int = 1,
        update_mode: UpdateMode = "continue",
        stream_interval: int = 1,
        device: str = "cpu",
        dtype: str = "auto",
        prefix_cache_bytes: int = 256 << 20,
    ) -> None:
        super().__init__(max_batch_size, weight_version, update_mode)
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {stream_interval}")
        self._stream_interval = stream_interval
        self._device = engine_device(device, tensor_parallel_size)
        check_model_dir(model_dir)
        self._model_dir = str(model_dir)
        self._decode_text: Callable[[list[int]], str] | None = None
        """The model's tokenizer's decoding, loaded for the first request with stop strings."""
        config = serving_config(model_dir, serving_dtype(dtype))
        self._shape = ModelShape.from_hf_config(config, f"model folder {model_dir}")
        self._dtype = weights_dtype(config)
        self._shape.check_tp(tensor_parallel_size)
        self._vocab_size = int(config.vocab_size)
        self._max_positions = int(config.max_position_embeddings)
        self._pad_id = int(config.pad_token_id if config.pad_token_id is not None else config.eos_token_id)
        heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        kv_bytes_per_token = (
            2 * int(config.num_hidden_layers) * heads * head_dim * self._dtype.itemsize // tensor_parallel_size
        )
        self._staged_version: int | None = None
        self._rng = torch.Generator(self._device).manual_seed(seed)
        self._cond = threading.Condition()
        self._waiting: deque[DecodingSequence] = deque()
        self._batch = RunningBatch(self._device)
        self._aborted: set[str] = set()
        self._swap: _Swap | None = None
        self._recompute_pending = False
        """abort-continue: the running sequences' KV cache is of an older version (decode thread only)."""
        self._halt_acks: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        """Who waits for the decode step in progress to end after a pause or a hold."""
        self._staging = threading.Lock()
        self._priority = SessionPriority()
        """Lowest while every sequence decoded is background work (decode thread only)."""
        self._stopped = False
        self._failure = ""
        self._thread = threading.Thread(target=self._loop, name="torch-engine", daemon=True)
        self._group = TensorParallelGroup(
            model_dir,
            tensor_parallel_size,
            transfer,
            weight_version,
            threads,
            self._fail,
            self._device,
            serving_dtype(dtype),
        )
        self.prefix_cache = PrefixCache(prefix_cache_bytes, kv_bytes_per_token, self._group.run)
        """Kept KV caches of finished session turns (decode thread only)."""

    @property
    def running_requests(self) -> int:
        return len(self._batch) + len(self._waiting)

    @property
    def tensor_parallel_size(self) -> int:
        return self._group.tp

    @property
    def ranks(self) -> Sequence[RankHandle]:
        return self._group.ranks

    def parameter_specs(self) -> list[ParameterSpec]:
        return [ParameterSpec(name, shape, self._dtype) for name, shape in hf_parameter_shapes(self._shape).items()]

    def rank_parameter_specs(self) -> list[ParameterSpec]:
        return [
            ParameterSpec(name, shape, self._dtype)
            for name, shape in tp_parameter_shapes(self._shape, self._group.tp).items()
        ]

    async def start(self) -> None:
        self._thread.start()

    async def stop(self) -> None:
        self.abort()
        with self._cond:
            self._stopped = True
            self._paused = False
            self._cond.notify_all()
        if self._thread.ident is not None:
            await asyncio.to_thread(self._thread.join)
        await asyncio.to_thread(self._group.close)

    async def generate(self, request: EngineRequest) -> AsyncIterator[Chunk]:
        validate_request(request, self._vocab_size, self._max_positions)
        stop = await self._stop_matcher(request.sampling.stop) if request.sampling.stop else None
        sequence = DecodingSequence(request, ChunkStream(asyncio.get_running_loop()), device=self._device, stop=stop)
        request_id = request.request_id
        with self._cond:
            if self._stopped:
                raise FailedPrecondition("engine is stopping")
            if self._failure:
                raise FailedPrecondition(f"engine failed: {self._failure}")
            if any(s.request.request_id == request_id and s.finish is Finish.NONE for s in self._batch.rows) or any(
                w.request.request_id == request_id for w in self._waiting
            ):
                raise InvalidArgument(f"request {request_id} is already running")
            check_pin(request, self._version, self._moving_on() and not self._pinned_live())
            self._aborted.discard(request_id)
            self._waiting.append(sequence)
            self._cond.notify_all()
        try:
            async for chunk in sequence.stream.chunks():
                yield chunk
        finally:
            if sequence.finish is Finish.NONE:
                self.abort([request_id])

    async def _stop_matcher(self, stops: tuple[str, ...]) -> StopMatcher:
        if self._decode_text is None:
            try:
                self._decode_text = await asyncio.to_thread(tokenizer_decoder, self._model_dir)
            except FileNotFoundError as exc:
                raise InvalidArgument(f"stop strings need the model's tokenizer: {exc}") from exc
        return StopMatcher(self._decode_text, stops)

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
        await self._halt(hold=False)

    async def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    async def hold_for_update(self) -> None:
        await self._halt(hold=True)

    async def release_update_hold(self) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()

    async def _halt(self, hold: bool) -> None:
        """Stops decoding (a pause, or a hold for a weight update); returns once the step in progress ended."""
        loop = asyncio.get_running_loop()
        acknowledged = loop.create_future()
        with self._cond:
            if hold:
                self._held = True
            else:
                self._paused = True
            self._halt_acks.append((loop, acknowledged))
            self._cond.notify_all()
        await acknowledged

    def stage_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Full tensors (WEIGHT_LAYOUT_FULL): each rank gets its own cut of them."""
        if not self._staging.acquire(blocking=False):
            raise FailedPrecondition("another version is being staged")
        try:
            with self._cond:
                self._check_stageable(version)
                self._staged_version = None
                served = self._version
            expected = {spec.name: spec.shape for spec in self.parameter_specs()}
            mismatch = name_mismatch(expected, tensors)
            if mismatch:
                raise InvalidArgument(f"weight names do not match the model: {mismatch}")
            for name, tensor in tensors.items():
                if tuple(tensor.shape) != expected[name]:
                    raise InvalidArgument(
                        f"{name}: shape {tuple(tensor.shape)} does not match the model's {expected[name]}"
                    )
            for rank in self.ranks:
                rank.stage(shard_full_tensors(tensors, self._shape, self._group.tp, rank.rank), served)
            with self._cond:
                self._staged_version = version
        finally:
            self._staging.release()

    def mark_staged(self, version: int) -> None:
        with self._cond:
            self._check_stageable(version)
            self._staged_version = version

    def _moving_on(self) -> bool:
        """Under the lock: a newer version is staged, being switched to, or held for (pause mode)."""
        return self._staged_version is not None or self._swap is not None or self._held

    def _pinned_live(self) -> bool:
        """Under the lock: a pinned request is running or waiting to join."""
        return any(s.pinned for s in self._batch.rows) or any(s.pinned for s in self._waiting)

    def _check_stageable(self, version: int) -> None:
        if version <= self._version:
            raise FailedPrecondition(f"version {version} is not newer than the served version {self._version}")
        if self._swap is not None:
            raise FailedPrecondition("a weight switch is already pending")

    async def commit_staged(self, version: int) -> None:
        loop = asyncio.get_running_loop()
        with self._cond:
            if self._failure:
                raise FailedPrecondition(f"engine failed: {self._failure}")
            if self._staged_version != version:
                raise FailedPrecondition(f"version {version} is not staged (staged: {self._staged_version})")
            swap = _Swap(version, loop.create_future(), loop)
            self._swap = swap
            self._cond.notify_all()
        try:
            await swap.done
        except asyncio.CancelledError:
            with self._cond:
                # The caller gave up while pinned requests held the switch back. Left pending, it
                # would switch later to a standby buffer the next push may already be rewriting.
                if self._swap is swap and not swap.claimed:
                    self._swap = None
            raise

    def _fail(self, reason: str) -> None:
        """The tensor-parallel group broke (a rank died): nothing can be decoded any more."""
        with self._cond:
            self._failure = reason
            self._cond.notify_all()
        if self.on_failure is not None:
            self.on_failure(reason)

    # The decode thread ----------------------------------------------------------------------

    def _halted(self) -> bool:
        # A hold for a weight update waits for the pinned requests: held, they could not end, and
        # the switch it is for waits for them.
        return self._paused or (self._held and not self._pinned_live())

    def _swap_due(self) -> bool:
        return self._swap is not None and not self._pinned_live()

    def _has_work(self) -> bool:
        if self._stopped or self._swap_due() or self._aborted:
            return True
        if self._failure:
            return bool(self._batch.rows or self._waiting)
        return not self._halted() and bool(self._batch.rows or self._waiting)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._acknowledge_halt()
                while not self._has_work():
                    self._cond.wait()
                    self._acknowledge_halt()
                if self._stopped:
                    return
                if self._failure:
                    self._abandon()
                    continue
                aborted, self._aborted = self._aborted, set()
                halted = self._halted()
                # Decided before pinned requests waiting to join leave the queue: they count.
                swap = self._swap if self._swap_due() else None
                if swap is not None:
                    swap.claimed = True
                joining: list[DecodingSequence] = []
                if not halted:
                    free = self._max_batch - len(self._batch)
                    joining = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
            emitted: list[tuple[DecodingSequence, Chunk]] = []
            self._take_priority_of(self._batch.rows + joining)
            try:
                if swap is not None:
                    self._apply_swap(swap)
                for sequence in self._batch.rows:
                    if sequence.request.request_id in aborted and sequence.finish is Finish.NONE:
                        emitted.append((sequence, sequence.take_chunk(Finish.ABORT)))
                self._drop_finished()
                # A recompute samples a token, so it waits while decoding is halted.
                if self._recompute_pending and not halted:
                    self._recompute(emitted)
                if joining:
                    self._prefill(joining, emitted)
                if self._batch.rows and not halted:
                    self._decode(emitted)
                self._drop_finished()
            except Exception:
                log.exception("decode step failed; its requests end aborted")
                for sequence in self._batch.rows + joining:
                    if sequence.finish is Finish.NONE:
                        emitted.append((sequence, sequence.take_chunk(Finish.ABORT)))
                self._batch = RunningBatch(self._device)
                self._recompute_pending = False
                try:
                    self._group.run("clear")
                except Exception as exc:
                    log.error("cannot clear the KV cache after a failed step", error=str(exc))
            self._take_priority_of(self._batch.rows)
            _deliver(emitted)

    def _take_priority_of(self, rows: list[DecodingSequence]) -> None:
        self._priority.lower(bool(rows) and all(row.request.background for row in rows))

    def _abandon(self) -> None:
        """Under the lock, once the group failed: every request ends aborted, a pending switch fails."""
        emitted = [
            (s, s.take_chunk(Finish.ABORT)) for s in self._batch.rows + list(self._waiting) if s.finish is Finish.NONE
        ]
        self._batch = RunningBatch(self._device)
        self._recompute_pending = False
        self._waiting.clear()
        self._aborted.clear()
        swap, self._swap = self._swap, None
        if swap is not None:
            error = FailedPrecondition(f"engine failed: {self._failure}")
            swap.loop.call_soon_threadsafe(lambda: swap.done.done() or swap.done.set_exception(error))
        _deliver(emitted)

    def _acknowledge_halt(self) -> None:
        # A hold waiting for pinned requests is acknowledged too: it takes effect once they ended.
        if self._paused or self._held or self._stopped:
            for loop, future in self._halt_acks:
                loop.call_soon_threadsafe(lambda f=future: f.done() or f.set_result(None))
            self._halt_acks.clear()

    def _apply_swap(self, swap: _Swap) -> None:
        self._group.run("switch", swap.version)
        self.prefix_cache.clear()
        with self._cond:
            self._swap = None
            self._version = swap.version
            self._staged_version = None
        if self.update_mode == "abort-continue" and self._batch.rows:
            self._recompute_pending = True
        swap.loop.call_soon_threadsafe(lambda: swap.done.done() or swap.done.set_result(None))
        log.info("weights switched", weight_version=swap.version, tensor_parallel_size=self._group.tp)

    def _drop_finished(self) -> None:
        keep = [i for i, row in enumerate(self._batch.rows) if row.finish is Finish.NONE]
        for index, row in enumerate(self._batch.rows):
            if row.finish in (Finish.STOP, Finish.LENGTH) and row.request.cache_key:
                # Every token of its context but the last sampled one, which was never fed.
                self.prefix_cache.keep(row.request.cache_key, row.context()[:-1], self._version, index, row.kv_version)
        if len(keep) < len(self._batch):
            self._group.run("keep", keep)
            self._batch.keep(keep)

    def _recompute(self, emitted: list[tuple[DecodingSequence, Chunk]]) -> None:
        """abort-continue: the running sequences leave the batch, their KV cache is dropped, and
        they join again prefilled from their prompt and tokens so far under the served version;
        each continues as a request continued from those tokens would (seeded draws included)."""
        self._recompute_pending = False
        rows = self._batch.rows
        if not rows:
            return
        self._group.run("clear")
        self._batch = RunningBatch(self._device)
        for sequence in rows:
            sequence.restart_generator()
        self._prefill(rows, emitted)
        log.info("running requests recomputed on the new weights", requests=len(rows), weight_version=self._version)

    def _prefill(self, joining: list[DecodingSequence], emitted: list[tuple[DecodingSequence, Chunk]]) -> None:
        """Prefills the joining sequences: one whose session's last turn left its KV cache here runs
        only its new tokens; the others are prefilled together, left-padded."""
        fresh = []
        for sequence in joining:
            context, key = sequence.context(), sequence.request.cache_key
            reused = self.prefix_cache.take(key, context, self._version)
            if reused is None:
                fresh.append(sequence)
                continue
            logits = self._group.run("prefill_prefixed", key, torch.tensor([context[reused:]]))
            # The kept prefix is the served version's (PrefixCache.take): all of its KV cache is.
            sequence.kv_version = self._version
            self._batch.join([sequence], self._sample([sequence], logits.float(), self._version, emitted))
        if fresh:
            self._prefill_together(fresh, emitted)

    def _prefill_together(self, joining: list[DecodingSequence], emitted: list[tuple[DecodingSequence, Chunk]]) -> None:
        inputs = [s.context() for s in joining]
        width = max(len(ids) for ids in inputs)
        ids = torch.tensor([[self._pad_id] * (width - len(x)) + x for x in inputs])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in inputs])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = self._group.run("prefill", ids, mask, positions)
        for sequence in joining:
            sequence.kv_version = self._version
        self._batch.join(joining, self._sample(joining, logits.float(), self._version, emitted))

    def _decode(self, emitted: list[tuple[DecodingSequence, Chunk]]) -> None:
        for sequence in self._batch.rows:
            # update_mode continue: a row prefilled before a switch now adds KV of the new version.
            if sequence.kv_version != self._version:
                sequence.kv_version = None
        logits = self._group.run("decode", self._batch.next_tokens)
        self._batch.next_tokens = self._sample(self._batch.rows, logits.float(), self._version, emitted)

    def _sample(
        self,
        rows: list[DecodingSequence],
        logits: torch.Tensor,
        version: int,
        emitted: list[tuple[DecodingSequence, Chunk]],
    ) -> torch.Tensor:
        """Samples one token per row (`draw`) and files it with its logprob in the row's next chunk."""
        tokens, chosen = draw(logits, [s.request.sampling for s in rows], [s.generator for s in rows], self._rng)
        for sequence, token, logprob in zip(rows, tokens.tolist(), chosen):
            if sequence.finish is not Finish.NONE:
                continue
            sequence.token_ids.append(token)
            self._generated += 1
            sequence.pending.token_ids.append(token)
            sequence.pending.logprobs.append(logprob)
            sequence.pending.weight_versions.append(version)
            if token in sequence.request.sampling.stop_token_ids or (
                sequence.stop is not None
                and sequence.stop.reached(sequence.request.continued_token_ids, sequence.token_ids)
            ):
                emitted.append((sequence, sequence.take_chunk(Finish.STOP)))
            elif len(sequence.token_ids) >= sequence.request.remaining_tokens:
                emitted.append((sequence, sequence.take_chunk(Finish.LENGTH)))
            elif len(sequence.pending.token_ids) >= self._stream_interval:
                emitted.append((sequence, sequence.take_chunk()))
        return tokens


def _deliver(emitted: list[tuple[DecodingSequence, Chunk]]) -> None:
    """One wake-up per event loop per decode step, however many requests got tokens."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[ChunkStream, Chunk]]] = defaultdict(list)
    for sequence, chunk in emitted:
        by_loop[sequence.stream.loop].append((sequence.stream, chunk))
    for loop, items in by_loop.items():
        loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[ChunkStream, Chunk]]) -> None:
    for stream, chunk in items:
        stream.put(chunk)
