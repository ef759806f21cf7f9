"""The relay shard's gRPC face: parse, validate, delegate to the shard."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from rlmesh.errors import FailedPrecondition, InvalidArgument, NotFound
from rlmesh.manager.v1 import relay_pb2, relay_pb2_grpc
from services.manager.relay.shard import RelayShard

MAX_FETCH = 4096
"""Most samples one FetchSamples call asks for."""


class RelayServicer(relay_pb2_grpc.RelayServiceServicer):
    def __init__(self, shard: RelayShard) -> None:
        self.shard = shard

    async def Relay(
        self, requests: AsyncIterator[relay_pb2.RelayRequest], context: grpc.aio.ServicerContext
    ) -> relay_pb2.RelayResponse:
        async for request in requests:
            for index, start in enumerate(request.starts):
                if not (start.request_id and start.address and start.attempt):
                    raise InvalidArgument(f"starts[{index}]: request_id, attempt and address are required")
                if start.continue_from > start.generate.sampling.max_tokens:
                    raise InvalidArgument(
                        f"starts[{index}]: continue_from {start.continue_from} is past max_tokens "
                        f"{start.generate.sampling.max_tokens}"
                    )
            self.shard.relay(request)
        return relay_pb2.RelayResponse()

    async def WatchRelay(
        self, request: relay_pb2.WatchRelayRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[relay_pb2.WatchRelayResponse]:
        watcher = self.shard.watch()
        try:
            while True:
                await watcher.wake.wait()
                yield relay_pb2.WatchRelayResponse(shard_incarnation=self.shard.incarnation, progress=watcher.take())
        finally:
            self.shard.watchers.discard(watcher)

    async def FetchSamples(
        self, request: relay_pb2.FetchSamplesRequest, context: grpc.aio.ServicerContext
    ) -> relay_pb2.FetchSamplesResponse:
        if len(request.payloads) > MAX_FETCH:
            raise InvalidArgument(f"payloads: at most {MAX_FETCH} a call, got {len(request.payloads)}")
        samples = []
        for index, payload in enumerate(request.payloads):
            try:
                samples.append(self.shard.store.fetch(payload.request_id, payload.token_count))
            except LookupError as exc:
                raise NotFound(f"payloads[{index}]: {exc}") from exc
            except ValueError as exc:
                raise FailedPrecondition(f"payloads[{index}]: {exc}") from exc
        return relay_pb2.FetchSamplesResponse(samples=samples)
