"""Pushes the latest version to every registered instance that is behind it: begin on the
instance, move the bytes with the configured backend, commit. Failures are retried with
backoff; the uploading trainer never waits on any of this."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc
import structlog

from rlmesh.manager.v1 import manager_pb2, manager_pb2_grpc
from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlmesh.rpc import call_options, open_channel
from rlmesh.transfer.base import TransferError, WeightSender
from services.weights.config import WeightsConfig
from services.weights.store import Snapshot, WeightStore

log = structlog.get_logger()


@dataclass(slots=True)
class PushState:
    instance_id: str
    address: str
    incarnation: int
    committed_version: int = -1
    pushing_version: int = 0
    last_push_ms: float = 0.0
    last_push_gbps: float = 0.0
    failures: int = 0
    last_error: str = ""
    retry_at: float = 0.0


class Pusher:
    def __init__(self, store: WeightStore, sender: WeightSender, config: WeightsConfig) -> None:
        self.store = store
        self.sender = sender
        self.config = config
        self.instances: dict[str, PushState] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._wake = asyncio.Event()
        self._manager_channel = open_channel(config.manager_address)
        self._manager = manager_pb2_grpc.ManagerServiceStub(self._manager_channel)

    def trigger(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.config.poll_interval_seconds)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self._reconcile()
            except grpc.aio.AioRpcError as exc:
                log.warning("cannot list instances", code=exc.code().name, error=exc.details())

    async def _reconcile(self) -> None:
        reply = await self._manager.ListInstances(manager_pb2.ListInstancesRequest(), **call_options(self.config.rpc_timeout_seconds))
        live = {i.instance_id: i for i in reply.instances}
        for instance_id, state in list(self.instances.items()):
            info = live.get(instance_id)
            # Gone, or registered again as a new process whose state starts over.
            if info is None or info.incarnation != state.incarnation:
                self._forget(instance_id)
        await self._close_unused_channels({i.address for i in live.values()})
        latest = self.store.latest
        now = time.monotonic()
        for instance_id, info in live.items():
            state = self.instances.setdefault(instance_id, PushState(instance_id, info.address, info.incarnation))
            state.committed_version = max(state.committed_version, info.weight_version)
            busy = instance_id in self._tasks
            if latest is None or busy or state.committed_version >= latest.version or now < state.retry_at:
                continue
            snapshot = self.store.acquire()
            assert snapshot is not None
            self._tasks[instance_id] = asyncio.create_task(self._push(state, snapshot))

    def _forget(self, instance_id: str) -> None:
        self.instances.pop(instance_id)
        task = self._tasks.pop(instance_id, None)
        if task:
            task.cancel()

    async def _close_unused_channels(self, live_addresses: set[str]) -> None:
        for address in self._channels.keys() - live_addresses:
            await self._channels.pop(address).close()

    def _stub(self, address: str) -> rollout_pb2_grpc.RolloutServiceStub:
        if address not in self._channels:
            self._channels[address] = open_channel(address)
        return rollout_pb2_grpc.RolloutServiceStub(self._channels[address])

    async def _push(self, state: PushState, snapshot: Snapshot) -> None:
        version = snapshot.version
        state.pushing_version = version
        started = time.perf_counter()
        structlog.contextvars.bind_contextvars(instance_id=state.instance_id, weight_version=version)
        try:
            stub = self._stub(state.address)
            timeout = self.config.rpc_timeout_seconds
            begin = await stub.BeginWeightUpdate(
                rollout_pb2.BeginWeightUpdateRequest(manifest=snapshot.manifest, backend=self.sender.backend),
                **call_options(timeout),
            )
            await self.sender.send(snapshot.manifest, snapshot.payload, stub, begin, self.config.push_timeout_seconds)
            await stub.CommitWeightUpdate(rollout_pb2.CommitWeightUpdateRequest(version=version), **call_options(self.config.push_timeout_seconds))
            elapsed = time.perf_counter() - started
            state.committed_version = max(state.committed_version, version)
            state.last_push_ms = elapsed * 1000
            state.last_push_gbps = snapshot.manifest.total_bytes / elapsed / 1e9
            state.failures = 0
            state.last_error = ""
            log.info("pushed", ms=round(state.last_push_ms, 2), gbps=round(state.last_push_gbps, 3))
        except (grpc.aio.AioRpcError, TransferError, TimeoutError) as exc:
            state.failures += 1
            message = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            state.last_error = message or type(exc).__name__
            backoff = min(30.0, self.config.retry_backoff_seconds * 2 ** (state.failures - 1))
            state.retry_at = time.monotonic() + backoff
            log.warning("push failed; instance keeps its old version", error=state.last_error, retry_in_s=backoff)
        finally:
            state.pushing_version = 0
            self.store.release(snapshot)
            if self._tasks.get(state.instance_id) is asyncio.current_task():
                del self._tasks[state.instance_id]
            self.trigger()

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        for channel in self._channels.values():
            await channel.close()
        await self._manager_channel.close()
        self.sender.close()
