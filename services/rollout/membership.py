"""Keeps this instance in the manager's pool: register at start, renew the lease by heartbeat
(at once after a weight switch), register again if the lease was lost, deregister on drain."""

from __future__ import annotations

import asyncio

import grpc
import structlog

from rlmesh.manager.v1 import manager_pb2, manager_pb2_grpc
from rlmesh.rpc import call_options, open_channel
from services.rollout.engine import Engine

log = structlog.get_logger()


class Membership:
    def __init__(self, manager_address: str, instance_id: str, address: str, engine: Engine, rpc_timeout: float, preemptible: bool = False) -> None:
        self.instance_id = instance_id
        self.preemptible = preemptible
        self.draining = False
        self.address = address
        self.engine = engine
        self.rpc_timeout = rpc_timeout
        self._channel = open_channel(manager_address)
        self._stub = manager_pb2_grpc.ManagerServiceStub(self._channel)
        self._interval = 1.0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def register(self, timeout: float) -> None:
        """Retries until the manager accepts the registration or `timeout` passes."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                reply = await self._stub.RegisterInstance(
                    manager_pb2.RegisterInstanceRequest(
                        instance_id=self.instance_id,
                        address=self.address,
                        weight_version=self.engine.weight_version,
                        max_batch_size=self.engine.max_batch_size,
                        preemptible=self.preemptible,
                    ),
                    **call_options(self.rpc_timeout),
                )
                self._interval = reply.heartbeat_interval_seconds
                log.info("registered with manager", instance_id=self.instance_id, lease_seconds=reply.lease_seconds)
                return
            except grpc.aio.AioRpcError as exc:
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError(f"manager unreachable for {timeout:.0f}s: {exc.details()}") from exc
                await asyncio.sleep(0.5)

    def start_heartbeats(self) -> None:
        self._task = asyncio.create_task(self._heartbeats())

    def wake(self) -> None:
        """Reports a new state (weight version) now rather than at the next interval."""
        self._wake.set()

    async def _heartbeats(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self._interval)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self._heartbeat()
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    log.warning("lease lost; registering again")
                    try:
                        await self.register(timeout=self.rpc_timeout)
                    except TimeoutError as err:
                        log.warning("re-registration failed", error=str(err))
                else:
                    log.warning("heartbeat failed", code=exc.code().name, error=exc.details())

    async def _heartbeat(self) -> None:
        await self._stub.Heartbeat(
            manager_pb2.HeartbeatRequest(instance_id=self.instance_id, weight_version=self.engine.weight_version, draining=self.draining),
            **call_options(self.rpc_timeout),
        )

    async def announce_drain(self) -> None:
        """Tells the manager to give this instance no more work (before its requests are handed back)."""
        self.draining = True
        try:
            await self._heartbeat()
        except grpc.aio.AioRpcError as exc:
            log.warning("could not announce the drain", code=exc.code().name, error=exc.details())

    async def deregister(self) -> None:
        if self._task:
            self._task.cancel()
        try:
            await self._stub.DeregisterInstance(
                manager_pb2.DeregisterInstanceRequest(instance_id=self.instance_id), **call_options(self.rpc_timeout)
            )
            log.info("deregistered from manager")
        except grpc.aio.AioRpcError as exc:
            log.warning("deregistration failed", code=exc.code().name, error=exc.details())
        await self._channel.close()
