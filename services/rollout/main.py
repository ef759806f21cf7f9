"""Runs one rollout instance: load the engine, serve, join the manager's pool, drain on SIGTERM
or a preemption notice."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch

from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlmesh.rpc import GrpcServer
from rlmesh.transfer.base import ReceiveBuffer
from services.rollout.config import EngineConfig, RolloutConfig
from services.rollout.engine import Engine
from services.rollout.membership import Membership
from services.rollout.server import RolloutServicer
from services.rollout.weight_update import WeightUpdater

log = structlog.get_logger()


def build_engine(config: EngineConfig) -> Engine:
    if config.kind == "synthetic":
        from services.rollout.synthetic_engine import SyntheticEngine

        return SyntheticEngine(config.synthetic, config.max_batch_size, config.model_dir or None)
    if config.kind == "vllm":
        from services.rollout.vllm_engine import VllmEngine

        return VllmEngine(config.model_dir, config.max_batch_size, config.seed, config.vllm)
    from services.rollout.torch_engine import TorchEngine

    return TorchEngine(config.model_dir, config.max_batch_size, config.seed)


def build_updater(config: RolloutConfig, engine: Engine) -> WeightUpdater:
    if not config.transfer.mooncake:
        return WeightUpdater(engine, ReceiveBuffer())
    from rlmesh.transfer.mooncake import MooncakeEndpoint, MooncakeReceiveBuffer

    endpoint = MooncakeEndpoint(config.server.advertised_host, config.transfer.mooncake_protocol)
    return WeightUpdater(engine, MooncakeReceiveBuffer(endpoint), endpoint.session)


@dataclass(slots=True)
class RunningRollout:
    server: GrpcServer
    engine: Engine
    servicer: RolloutServicer
    membership: Membership
    drain_timeout: float
    stop_requested: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the instance was told to leave (a preemption notice): the process then stops."""
    _drained: int | None = None

    async def drain(self, reason: str) -> int:
        """Leaves the pool without losing work: the manager stops sending requests, the running
        ones end with the tokens generated so far (which the manager continues elsewhere), and
        only once their streams delivered that last chunk does the instance deregister."""
        if self._drained is not None:
            return self._drained
        log.info("draining", reason=reason)
        await self.membership.announce_drain()
        await self.server.set_serving(False)
        if self.engine.paused:
            await self.engine.resume()
        self._drained = self.engine.abort()
        deadline = time.monotonic() + self.drain_timeout
        while self.servicer.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await self.membership.deregister()
        log.info("drained", handed_back_requests=self._drained, streams_left=self.servicer.streams)
        self.stop_requested.set()
        return self._drained

    async def stop(self) -> None:
        await self.drain("shutting down")
        await self.server.stop()
        await self.engine.stop()


async def start(config: RolloutConfig) -> RunningRollout:
    structlog.contextvars.bind_contextvars(instance_id=config.instance_id)
    torch.set_num_threads(config.engine.threads)
    engine = build_engine(config.engine)
    model_name = Path(config.engine.model_dir).name if config.engine.model_dir else "synthetic"
    servicer = RolloutServicer(config.instance_id, model_name, config.engine.kind, engine, build_updater(config, engine), config.preemptible)
    server = GrpcServer(config.server, [rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name])
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server.server)
    await engine.start()
    await server.start()
    membership = Membership(config.manager_address, config.instance_id, server.address, engine, config.rpc_timeout_seconds, config.preemptible)
    servicer.membership = membership
    await server.set_serving(True)
    running = RunningRollout(server, engine, servicer, membership, config.drain_timeout_seconds)
    servicer.drain = running.drain
    try:
        await membership.register(config.register_timeout_seconds)
    except TimeoutError:
        await running.stop()
        raise
    membership.start_heartbeats()
    return running

