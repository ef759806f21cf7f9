"""Keeps this instance in the manager's pool: register at start, renew the lease by heartbeat
(at once after a weight switch; retried with backoff while the manager is unreachable), register
again if the lease was lost, deregister on drain; every call carries this process's incarnation token."""

from __future__ import annotations

import asyncio

import grpc
import structlog

from rlmesh.manager.v1 import manager_pb2, manager_pb2_grpc
from rlmesh.rpc.channels import call_options, open_channel
from services.rollout.engine import Engine

log = structlog.get_logger()

UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
"""A manager that restarts, or a cut network: the lease may still hold when it answers again."""
RETRY_BACKOFF_SECONDS = (0.25, 0.5, 1.0, 2.0)
"""Waits between heartbeats to an unreachable manager (never longer than the heartbeat interval)."""


class Membership:
    def __init__(
        self,
        manager_address: str,
        instance_id: str,
        address: str,
        engine: Engine,
        rpc_timeout: float,
        preemptible: bool = False,
        saturation_batch_size: int = 0,
    ) -> None:
        self.instance_id = instance_id
        self.preemptible = preemptible
        self.saturation_batch_size = saturation_batch_size
        self.draining = False
        self.address = address
        self.engine = engine
        self.rpc_timeout = rpc_timeout
        self._channel = open_channel(manager_address)
        self._stub = manager_pb2_grpc.ManagerServiceStub(self._channel)
        self.token = ""
        """This process's incarnation token, from its latest registration."""
        self._settled = asyncio.Event()
        """Clear while a RegisterInstance call is in flight."""
        self._settled.set()
        self._interval = 1.0
        self._lease = 10.0
        self._renewed_at = 0.0
        """Loop time of the last call the manager answered: the lease runs from there."""
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def register(self, timeout: float) -> None:
        """Retries until the manager accepts the registration or `timeout` passes (an earlier
        incarnation of this id, e.g. before a restart, holds it until its lease expires)."""
        deadline = asyncio.get_running_loop().time() + timeout
        waiting_logged = False
        while True:
            try:
                reply = await self._register_once()
                self._interval = reply.heartbeat_interval_seconds
                self._lease = reply.lease_seconds
                self._renewed_at = asyncio.get_running_loop().time()
                log.info("registered with manager", instance_id=self.instance_id, lease_seconds=reply.lease_seconds)
                return
            except grpc.aio.AioRpcError as exc:
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError(f"manager unreachable for {timeout:.0f}s: {exc.details()}") from exc
                if exc.code() == grpc.StatusCode.ALREADY_EXISTS and not waiting_logged:
                    log.warning("instance id taken; retrying until its lease expires", error=exc.details())
                    waiting_logged = True
                await asyncio.sleep(0.5)

    async def _register_once(self) -> manager_pb2.RegisterInstanceResponse:
        self._settled.clear()
        try:
            reply = await self._stub.RegisterInstance(
                manager_pb2.RegisterInstanceRequest(
                    instance_id=self.instance_id,
                    address=self.address,
                    weight_version=self.engine.weight_version,
                    max_batch_size=self.engine.max_batch_size,
                    saturation_batch_size=self.saturation_batch_size,
                    preemptible=self.preemptible,
                    incarnation_token=self.token,
                ),
                **call_options(self.rpc_timeout),
            )
            self.token = reply.incarnation_token
            return reply
        finally:
            self._settled.set()

    async def is_incarnation(self, token: str) -> bool:
        """Whether `token` (carried by a manager's Generate) is this process's. The manager may
        dispatch to a new incarnation before the reply that names it has arrived here: a token that
        does not match yet is judged once the registration in flight has settled."""
        if token != self.token and not self._settled.is_set():
            await self._settled.wait()
        return token == self.token

    def start_heartbeats(self) -> None:
        self._task = asyncio.create_task(self._heartbeats())

    def wake(self) -> None:
        """Reports a new state (weight version) now rather than at the next interval."""
        self._wake.set()

    async def _heartbeats(self) -> None:
        unanswered = 0
        while True:
            backoff = (
                RETRY_BACKOFF_SECONDS[min(unanswered, len(RETRY_BACKOFF_SECONDS)) - 1] if unanswered else self._interval
            )
            try:
                await asyncio.wait_for(self._wake.wait(), min(self._interval, backoff))
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self._heartbeat()
                if unanswered:
                    log.info("manager reachable again; lease renewed", unanswered_heartbeats=unanswered)
                unanswered = 0
            except grpc.aio.AioRpcError as exc:
                # PERMISSION_DENIED: the manager dropped this incarnation and another process took the
                # id; this one may have it back once that one's lease expires.
                if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED):
                    log.warning("lease lost; registering again", code=exc.code().name, error=exc.details())
                    unanswered = 0
                    await self._register_again()
                elif exc.code() in UNREACHABLE:
                    unanswered += 1
                    if asyncio.get_running_loop().time() - self._renewed_at > self._lease:
                        log.warning(
                            "manager unreachable for longer than the lease; registering again",
                            code=exc.code().name,
                            unanswered_heartbeats=unanswered,
                        )
                        await self._register_again()
                    elif unanswered == 1:
                        log.warning(
                            "manager unreachable; retrying heartbeats while the lease holds",
                            code=exc.code().name,
                            error=exc.details(),
                        )
                else:
                    log.warning("heartbeat failed", code=exc.code().name, error=exc.details())

    async def _register_again(self) -> None:
        """With this incarnation's token: a manager that still holds the lease keeps the incarnation and
        its requests."""
        try:
            await self.register(timeout=self.rpc_timeout)
        except TimeoutError as err:
            log.warning("re-registration failed", error=str(err))

    async def _heartbeat(self) -> None:
        await self._stub.Heartbeat(
            manager_pb2.HeartbeatRequest(
                instance_id=self.instance_id,
                weight_version=self.engine.weight_version,
                draining=self.draining,
                incarnation_token=self.token,
            ),
            **call_options(self.rpc_timeout),
        )
        self._renewed_at = asyncio.get_running_loop().time()

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
                manager_pb2.DeregisterInstanceRequest(instance_id=self.instance_id, incarnation_token=self.token),
                **call_options(self.rpc_timeout),
            )
            log.info("deregistered from manager")
        except grpc.aio.AioRpcError as exc:
            log.warning("deregistration failed", code=exc.code().name, error=exc.details())
        await self._channel.close()
