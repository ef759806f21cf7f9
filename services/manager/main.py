"""Runs the manager: serve the registry and scheduler until SIGTERM."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import structlog

from rlmesh.manager.v1 import manager_pb2, manager_pb2_grpc
from rlmesh.rpc.servers import GrpcServer
from services.manager.config import ManagerConfig
from services.manager.dispatcher import Changes, Dispatcher
from services.manager.domain.state import ManagerState
from services.manager.gateway.process import GatewayProcess, bind
from services.manager.journal import Journal, NoJournal, open_journal
from services.manager.leases import watch_leases
from services.manager.server import ManagerServicer
from services.manager.session_feed import SessionFeed
from services.manager.stored_versions import StoredVersions


@dataclass(slots=True)
class RunningManager:
    server: GrpcServer
    state: ManagerState
    dispatcher: Dispatcher
    leases: asyncio.Task[None]
    journal: Journal | NoJournal
    journaling: asyncio.Task[None]
    stored_versions: StoredVersions
    session_feed: SessionFeed
    gateway: GatewayProcess | None = None

    @property
    def gateway_address(self) -> str:
        return self.gateway.address if self.gateway is not None else ""

    async def stop(self) -> None:
        self.leases.cancel()
        self.journaling.cancel()
        if self.gateway is not None:
            await self.gateway.stop()
        await self.server.stop()
        await self.dispatcher.close()
        await self.stored_versions.close()
        self.journal.flush(self.state)
        self.journal.close()


log = structlog.get_logger()


async def keep_journal(state: ManagerState, journal: Journal | NoJournal, period: float) -> None:
    """Writes the tokens generated since the last flush; the calls that must be durable before
    their reply flush by themselves."""
    while True:
        await asyncio.sleep(period)
        try:
            journal.flush(state)
        except Exception:
            log.exception("journal write failed; trying again")


async def start(config: ManagerConfig) -> RunningManager:
    state = ManagerState(
        config.lease_seconds, config.max_staleness, config.dispatch_policy, queue_ahead=config.queue_ahead
    )
    journal = open_journal(config.journal_path)
    batches, instances = journal.restore(state, time.monotonic())
    if batches or instances:
        log.info(
            "restored from the journal",
            journal=config.journal_path,
            batches=batches,
            instances=instances,
            queued_samples=len(state.queue),
            published_version=state.published_version,
        )
    changes = Changes()
    dispatcher = Dispatcher(state, changes, config)
    service = manager_pb2.DESCRIPTOR.services_by_name["ManagerService"].full_name
    server = GrpcServer(config.server, [service])
    stored_versions = StoredVersions(config.weights_address, config.rpc_timeout_seconds, config.store_wait_seconds)
    servicer = ManagerServicer(state, dispatcher, changes, config, journal, stored_versions, server.authorization)
    manager_pb2_grpc.add_ManagerServiceServicer_to_server(servicer, server.server)
    gateway_socket = await bind(config.server.host, config.gateway_port) if config.gateway_port is not None else None
    await server.start()
    await server.serve_metrics("manager", servicer.collect_metrics)
    leases = asyncio.create_task(watch_leases(state, dispatcher, changes))
    journaling = asyncio.create_task(keep_journal(state, journal, config.journal_flush_seconds))
    dispatcher.dispatch()
    gateway = await GatewayProcess.start(config, server.address, gateway_socket) if gateway_socket is not None else None
    await server.set_serving(True)
    return RunningManager(
        server, state, dispatcher, leases, journal, journaling, stored_versions, servicer.session_feed, gateway
    )
