"""Runs the weights service: store uploads, push them to instances, until SIGTERM."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from rlmesh.lifecycle import background_process
from rlmesh.rpc.servers import GrpcServer
from rlmesh.transfer.base import WeightSender
from rlmesh.transfer.grpc_stream import GrpcStreamSender
from rlmesh.transfer.tcp import TcpSender
from rlmesh.weights.v1 import weights_pb2, weights_pb2_grpc
from services.weights.config import WeightsConfig
from services.weights.pusher import Pusher
from services.weights.server import WeightsServicer
from services.weights.store import WeightStore


def build_sender(config: WeightsConfig) -> WeightSender:
    if config.backend == "grpc":
        return GrpcStreamSender()
    if config.backend == "tcp":
        return TcpSender(background=config.background_priority)
    from rlmesh.transfer.mooncake import MooncakeEndpoint, MooncakeSender

    return MooncakeSender(MooncakeEndpoint(config.server.advertised_host, config.mooncake_protocol))


@dataclass(slots=True)
class RunningWeights:
    server: GrpcServer
    store: WeightStore
    pusher: Pusher
    pushing: asyncio.Task[None]

    async def stop(self) -> None:
        self.pushing.cancel()
        await self.server.stop()
        await self.pusher.close()


async def start(config: WeightsConfig) -> RunningWeights:
    if config.background_priority:
        background_process()
    store = WeightStore(max_bytes=int(config.max_version_gb * (1 << 30)))
    pusher = Pusher(store, build_sender(config), config)
    server = GrpcServer(config.server, [weights_pb2.DESCRIPTOR.services_by_name["WeightsService"].full_name])
    servicer = WeightsServicer(store, pusher, config.backend)
    weights_pb2_grpc.add_WeightsServiceServicer_to_server(servicer, server.server)
    await server.start()
    await server.serve_metrics("weights", servicer.collect_metrics)
    pushing = asyncio.create_task(pusher.run())
    await server.set_serving(True)
    return RunningWeights(server, store, pusher, pushing)
