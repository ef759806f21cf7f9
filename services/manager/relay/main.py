"""Runs a relay shard: serve the manager's requests and the trainer's fetches until SIGTERM."""

from __future__ import annotations

from dataclasses import dataclass

from rlmesh.manager.v1 import relay_pb2, relay_pb2_grpc
from rlmesh.rpc.servers import GrpcServer
from services.manager.relay.config import RelayConfig
from services.manager.relay.server import RelayServicer
from services.manager.relay.shard import RelayShard


@dataclass(slots=True)
class RunningRelay:
    server: GrpcServer
    shard: RelayShard

    async def stop(self) -> None:
        await self.server.stop()
        await self.shard.close()


async def start(config: RelayConfig) -> RunningRelay:
    shard = RelayShard(config)
    server = GrpcServer(config.server, [relay_pb2.DESCRIPTOR.services_by_name["RelayService"].full_name])
    relay_pb2_grpc.add_RelayServiceServicer_to_server(RelayServicer(shard), server.server)
    await server.start()
    await server.set_serving(True)
    return RunningRelay(server, shard)
