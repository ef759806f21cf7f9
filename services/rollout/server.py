"""The RolloutService servicer: parses and validates requests, then delegates to the engine
and the weight updater."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import structlog

from rlmesh.chat.stop_strings import stop_problem
from rlmesh.common.v1 import common_pb2
from rlmesh.errors import DomainError, FailedPrecondition, InvalidArgument, PermissionDenied
from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlmesh.rpc.prometheus import Families
from rlmesh.rpc.servers import status_code_of
from rlmesh.sampling import sampling_problem
from rlmesh.transfer.auth import UnprovenPayload
from services.rollout.engine import Chunk, Engine, EngineRequest, Finish, Sampling, WeightLayout
from services.rollout.membership import Membership
from services.rollout.torch.rank import RankPort
from services.rollout.weight_update import Backend, WeightUpdater

log = structlog.get_logger()

_BACKENDS: dict[int, Backend] = {
    rollout_pb2.TRANSFER_BACKEND_MOONCAKE: "mooncake",
    rollout_pb2.TRANSFER_BACKEND_GRPC: "grpc",
    rollout_pb2.TRANSFER_BACKEND_TCP: "tcp",
}
_LAYOUTS = {
    WeightLayout.FULL: rollout_pb2.WEIGHT_LAYOUT_FULL,
    WeightLayout.TENSOR_PARALLEL: rollout_pb2.WEIGHT_LAYOUT_TENSOR_PARALLEL,
}

_FINISH = {
    Finish.NONE: common_pb2.FINISH_REASON_UNSPECIFIED,
    Finish.STOP: common_pb2.FINISH_REASON_STOP,
    Finish.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    Finish.ABORT: common_pb2.FINISH_REASON_ABORT,
}


def sampling_from_proto(params: common_pb2.SamplingParams) -> Sampling:
    problem = sampling_problem(params.temperature, params.top_p, params.max_tokens, params.seed)
    if problem:
        raise InvalidArgument(f"sampling.{problem}")
    problem = stop_problem(params.stop)
    if problem:
        raise InvalidArgument(f"sampling.stop: {problem}")
    return Sampling(
        temperature=params.temperature,
        top_p=params.top_p or 1.0,
        max_tokens=params.max_tokens,
        stop_token_ids=frozenset(params.stop_token_ids),
        seed=params.seed,
        stop=tuple(params.stop),
    )


def refusal(request_id: str, code: grpc.StatusCode, message: str) -> rollout_pb2.GenerateRefusal:
    return rollout_pb2.GenerateRefusal(request_id=request_id, code=code.value[0], message=message)


def endpoint_to_proto(port: RankPort) -> rollout_pb2.RankEndpoint:
    return rollout_pb2.RankEndpoint(
        tp_rank=port.tp_rank,
        transfer_session=port.transfer_session,
        buffer_address=port.buffer_address,
        buffer_bytes=port.buffer_bytes,
        data_address=port.data_address,
        held_version=port.held_version,
        session_secret=port.session_secret,
    )


def chunk_to_proto(chunk: Chunk) -> common_pb2.TokenChunk:
    return common_pb2.TokenChunk(
        request_id=chunk.request_id,
        token_ids=chunk.token_ids,
        logprobs=chunk.logprobs,
        weight_versions=chunk.weight_versions,
        finish_reason=_FINISH[chunk.finish],
    )


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(
        self,
        instance_id: str,
        model_name: str,
        engine_kind: str,
        engine: Engine,
        updater: WeightUpdater,
        preemptible: bool,
    ) -> None:
        self.instance_id = instance_id
        self.model_name = model_name
        self.engine_kind = engine_kind
        self.engine = engine
        self.updater = updater
        self.preemptible = preemptible
        self.membership: Membership | None = None
        self.drain: Callable[[str], Awaitable[int]] | None = None
        """Set by the process: hands running requests back and stops the instance."""
        self.open_responses = 0
        """Responses not yet ended (Generate streams, requests of GenerateMany streams): a drain
        waits for them to deliver their last chunk."""
        self._scraped: tuple[float, int] | None = None
        """(time, generated tokens) at the last metrics scrape: tokens/s is measured between scrapes."""

    async def _engine_request(self, request: rollout_pb2.GenerateRequest) -> EngineRequest:
        if not request.request_id:
            raise InvalidArgument("request_id is required")
        if (
            request.incarnation_token
            and self.membership
            and not await self.membership.is_incarnation(request.incarnation_token)
        ):
            raise PermissionDenied(
                f"instance {self.instance_id!r}: the request was dispatched to another incarnation of this id; "
                "this process restarted or has not registered as it yet"
            )
        if self.membership and self.membership.draining:
            raise FailedPrecondition("this instance is draining and takes no new requests")
        return EngineRequest(
            request.request_id,
            list(request.prompt_token_ids),
            sampling_from_proto(request.sampling),
            list(request.continued_token_ids),
            request.pinned_version if request.HasField("pinned_version") else None,
            request.background,
            request.cache_key,
        )

    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rollout_pb2.GenerateResponse]:
        engine_request = await self._engine_request(request)
        self.open_responses += 1
        try:
            async for chunk in self.engine.generate(engine_request):
                yield rollout_pb2.GenerateResponse(chunk=chunk_to_proto(chunk))
        finally:
            self.open_responses -= 1

    async def GenerateMany(
        self, request_iterator: AsyncIterator[rollout_pb2.GenerateManyRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rollout_pb2.GenerateManyResponse]:
        outbox: asyncio.Queue[common_pb2.TokenChunk | rollout_pb2.GenerateRefusal | None] = asyncio.Queue()
        """Chunks and refusals to send; None only wakes the writer (a request or the reader ended)."""
        running: dict[str, asyncio.Task[None]] = {}
        cancelled: set[str] = set()
        """Cancelled while their task had not reached the engine yet, where an abort finds them."""

        async def run(request: rollout_pb2.GenerateRequest) -> None:
            finished = False
            try:
                engine_request = await self._engine_request(request)
                if request.request_id in cancelled:
                    outbox.put_nowait(
                        common_pb2.TokenChunk(
                            request_id=request.request_id, finish_reason=common_pb2.FINISH_REASON_ABORT
                        )
                    )
                    return
                async for chunk in self.engine.generate(engine_request):
                    finished = chunk.finish is not Finish.NONE
                    outbox.put_nowait(chunk_to_proto(chunk))
                if not finished:
                    outbox.put_nowait(
                        refusal(request.request_id, grpc.StatusCode.INTERNAL, "the engine ended the request unfinished")
                    )
            except DomainError as exc:
                outbox.put_nowait(refusal(request.request_id, status_code_of(exc), str(exc)))
            except Exception as exc:
                log.exception("request failed", request_id=request.request_id)
                outbox.put_nowait(
                    refusal(request.request_id, grpc.StatusCode.INTERNAL, f"the instance failed the request: {exc}")
                )
            finally:
                running.pop(request.request_id, None)
                cancelled.discard(request.request_id)
                self.open_responses -= 1
                outbox.put_nowait(None)

        async def read() -> None:
            try:
                async for message in request_iterator:
                    for request in message.requests:
                        if request.request_id in running:
                            outbox.put_nowait(
                                refusal(
                                    request.request_id,
                                    grpc.StatusCode.INVALID_ARGUMENT,
                                    f"request {request.request_id} is already running on this stream",
                                )
                            )
                            continue
                        self.open_responses += 1
                        running[request.request_id] = asyncio.create_task(run(request))
                    own = [i for i in message.cancel_request_ids if i in running]
                    if own:
                        cancelled.update(own)
                        self.engine.abort(own)
            finally:
                outbox.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while not (reader.done() and not running and outbox.empty()):
                items = [await outbox.get()]
                # Let the other requests of the same decode step put their chunks in first.
                await asyncio.sleep(0)
                while not outbox.empty():
                    items.append(outbox.get_nowait())
                chunks = [i for i in items if isinstance(i, common_pb2.TokenChunk)]
                refusals = [i for i in items if isinstance(i, rollout_pb2.GenerateRefusal)]
                if chunks or refusals:
                    yield rollout_pb2.GenerateManyResponse(chunks=chunks, refusals=refusals)
            reader.result()
        finally:
            tasks = [reader, *running.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def Abort(
        self, request: rollout_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.AbortResponse:
        if not request.all and not request.request_ids:
            raise InvalidArgument("name request_ids or set all")
        aborted = self.engine.abort(None if request.all else list(request.request_ids))
        return rollout_pb2.AbortResponse(aborted=aborted)

    async def GetInfo(
        self, request: rollout_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.GetInfoResponse:
        return rollout_pb2.GetInfoResponse(
            instance_id=self.instance_id,
            model=self.model_name,
            weight_version=self.engine.weight_version,
            running_requests=self.engine.running_requests,
            max_batch_size=self.engine.max_batch_size,
            generated_tokens=self.engine.generated_tokens,
            transfer_session=self.updater.transfer_session,
            engine=self.engine_kind,
            paused=self.engine.paused,
            preemptible=self.preemptible,
            draining=bool(self.membership and self.membership.draining),
            tensor_parallel_size=self.engine.tensor_parallel_size,
            weight_layout=_LAYOUTS[self.engine.weight_layout],
            quantized_weights=self.engine.quantized_weights,
            update_mode=self.engine.update_mode,
        )

    async def collect_metrics(self, families: Families) -> None:
        """What Prometheus scrapes: the figures of GetInfo, and tokens/s since the last scrape."""
        info = await self.GetInfo(rollout_pb2.GetInfoRequest(), None)
        now = time.monotonic()
        rate = 0.0
        if self._scraped is not None and now > self._scraped[0]:
            rate = (info.generated_tokens - self._scraped[1]) / (now - self._scraped[0])
        self._scraped = (now, info.generated_tokens)
        labels = {"instance": info.instance_id, "engine": info.engine}
        families.counter(
            "generated_tokens", "Tokens generated since the instance started.", info.generated_tokens, **labels
        )
        families.gauge("tokens_per_second", "Tokens generated per second since the previous scrape.", rate, **labels)
        families.gauge("running_requests", "Requests being decoded.", info.running_requests, **labels)
        families.gauge("max_batch_size", "Sequences the engine decodes at once.", info.max_batch_size, **labels)
        families.gauge("weight_version", "Weight version the instance serves.", info.weight_version, **labels)
        families.gauge("paused", "1 while generation is paused (a weight update in pause mode).", info.paused, **labels)
        families.gauge(
            "draining", "1 while the instance hands its requests back before leaving.", info.draining, **labels
        )

    async def BeginWeightUpdate(
        self, request: rollout_pb2.BeginWeightUpdateRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.BeginWeightUpdateResponse:
        backend = _BACKENDS.get(request.backend)
        if backend is None:
            raise InvalidArgument(
                "backend must be TRANSFER_BACKEND_MOONCAKE, TRANSFER_BACKEND_GRPC or TRANSFER_BACKEND_TCP"
            )
        if request.HasField("manifest") == bool(request.rank_manifests):
            raise InvalidArgument(
                "set exactly one of manifest (full tensors) and rank_manifests (one payload per tensor-parallel rank)"
            )
        manifest = request.manifest if request.HasField("manifest") else None
        keep_base = request.link_compression == common_pb2.COMPRESSION_DELTA
        ports = await self.updater.begin(manifest, list(request.rank_manifests), backend, keep_base)
        first = ports[0]
        mooncake = backend == "mooncake"
        return rollout_pb2.BeginWeightUpdateResponse(
            transfer_session=first.transfer_session if mooncake else "",
            buffer_address=first.buffer_address if mooncake else 0,
            buffer_bytes=first.buffer_bytes,
            ranks=[endpoint_to_proto(port) for port in ports],
        )

    async def PushWeightChunks(
        self, request_iterator: AsyncIterator[rollout_pb2.PushWeightChunksRequest], context: grpc.aio.ServicerContext
    ) -> rollout_pb2.PushWeightChunksResponse:
        received = 0
        async for chunk in request_iterator:
            await self.updater.receive(
                chunk.tp_rank,
                chunk.version,
                chunk.offset,
                chunk.data,
                chunk.compression,
                chunk.raw_bytes,
                chunk.base_version,
            )
            received += chunk.raw_bytes or len(chunk.data)
        return rollout_pb2.PushWeightChunksResponse(received_bytes=received)

    async def CommitWeightUpdate(
        self, request: rollout_pb2.CommitWeightUpdateRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.CommitWeightUpdateResponse:
        try:
            load_ms = await self.updater.commit(request.version, list(request.rank_proofs))
        except UnprovenPayload as exc:
            # Not DATA_LOSS: nothing was lost in transit, the bytes are someone else's.
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        if self.membership:
            self.membership.wake()
        return rollout_pb2.CommitWeightUpdateResponse(weight_version=self.engine.weight_version, load_ms=load_ms)

    async def PauseGeneration(
        self, request: rollout_pb2.PauseGenerationRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.PauseGenerationResponse:
        await self.engine.pause()
        return rollout_pb2.PauseGenerationResponse(held_requests=self.engine.running_requests)

    async def ResumeGeneration(
        self, request: rollout_pb2.ResumeGenerationRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.ResumeGenerationResponse:
        await self.engine.resume()
        return rollout_pb2.ResumeGenerationResponse()

    async def Drain(
        self, request: rollout_pb2.DrainRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.DrainResponse:
        if self.drain is None:
            raise FailedPrecondition("this instance cannot drain yet: it is still starting")
        handed_back = await self.drain(request.reason or "drain requested")
        return rollout_pb2.DrainResponse(handed_back_requests=handed_back)
