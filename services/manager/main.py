"""Runs the manager: serve the registry and scheduler until SIGTERM."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from rlmesh.manager.v1 import manager_pb2, manager_pb2_grpc
from rlmesh.rpc import GrpcServer, RegistrationTokenInterceptor, use_tls
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


INSTANCE_METHODS = ("RegisterInstance", "Heartbeat", "DeregisterInstance")
"""The calls only rollout instances make: with a registration token they must carry it."""


async def start(config: ManagerConfig) -> RunningManager:
    use_tls(config.server.tls)
    state = ManagerState(config.lease_seconds, config.max_staleness, config.dispatch_policy)
    changes = Changes()
    dispatcher = Dispatcher(state, changes, config)
    service = manager_pb2.DESCRIPTOR.services_by_name["ManagerService"].full_name
    interceptors = []
    if config.registration_token:
        interceptors.append(RegistrationTokenInterceptor(config.registration_token, [f"/{service}/{name}" for name in INSTANCE_METHODS]))
    server = GrpcServer(config.server, [service], interceptors=interceptors)
    manager_pb2_grpc.add_ManagerServiceServicer_to_server(ManagerServicer(state, dispatcher, changes, config), server.server)
    await server.start()
    leases = asyncio.create_task(watch_leases(state, dispatcher, changes))
    await server.set_serving(True)
    return RunningManager(server, state, dispatcher, leases)

