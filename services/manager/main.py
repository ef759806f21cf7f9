"""Runs the manager: serve the registry and scheduler until SIGTERM."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from rlmesh.manager.v1 import manager_pb2, manager_pb2_grpc
from rlmesh.rpc import GrpcServer
from services.manager.config import ManagerConfig
from services.manager.server import Changes, Dispatcher, ManagerServicer, watch_leases
from services.manager.state import ManagerState


@dataclass(slots=True)
class RunningManager:
    server: GrpcServer
    state: ManagerState
    dispatcher: Dispatcher
    leases: asyncio.Task[None]

    async def stop(self) -> None:
        self.leases.cancel()
        await self.server.stop()
        await self.dispatcher.close()


async def start(config: ManagerConfig) -> RunningManager:
    state = ManagerState(config.lease_seconds, config.max_staleness, config.dispatch_policy)
    changes = Changes()
    dispatcher = Dispatcher(state, changes, config)
    server = GrpcServer(config.server, [manager_pb2.DESCRIPTOR.services_by_name["ManagerService"].full_name])
    manager_pb2_grpc.add_ManagerServiceServicer_to_server(ManagerServicer(state, dispatcher, changes, config), server.server)
    await server.start()
    leases = asyncio.create_task(watch_leases(state, dispatcher, changes))
    await server.set_serving(True)
    return RunningManager(server, state, dispatcher, leases)

