"""Runs one rollout instance: load the engine, serve, join the manager's pool, drain on SIGTERM."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlmesh.rpc import GrpcServer
from rlmesh.transfer.base import ReceiveBuffer
from services.rollout.config import RolloutConfig
from services.rollout.membership import Membership
from services.rollout.server import RolloutServicer
from services.rollout.torch_engine import TorchEngine
from services.rollout.weight_update import WeightUpdater

log = structlog.get_logger()


def build_updater(config: RolloutConfig, engine: TorchEngine) -> WeightUpdater:
    if not config.transfer.mooncake:
        return WeightUpdater(engine, ReceiveBuffer())
    from rlmesh.transfer.mooncake import MooncakeEndpoint, MooncakeReceiveBuffer

    endpoint = MooncakeEndpoint(config.server.advertised_host, config.transfer.mooncake_protocol)
    return WeightUpdater(engine, MooncakeReceiveBuffer(endpoint), endpoint.session)


@dataclass(slots=True)
class RunningRollout:
    server: GrpcServer
    engine: TorchEngine
    membership: Membership

    async def stop(self) -> None:
        """Drain: stop taking work, leave the pool (the manager continues our requests elsewhere), stop."""
        log.info("draining")
        await self.server.set_serving(False)
        await self.membership.deregister()
        self.engine.abort()
        await self.server.stop()
        await self.engine.stop()


async def start(config: RolloutConfig) -> RunningRollout:
    structlog.contextvars.bind_contextvars(instance_id=config.instance_id)
    torch.set_num_threads(config.engine.threads)
    engine = TorchEngine(config.engine.model_dir, config.engine.max_batch_size, config.engine.seed)
    servicer = RolloutServicer(config.instance_id, Path(config.engine.model_dir).name, engine, build_updater(config, engine))
    server = GrpcServer(config.server, [rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name])
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server.server)
    await engine.start()
    await server.start()
    membership = Membership(config.manager_address, config.instance_id, server.address, engine, config.rpc_timeout_seconds)
    servicer.membership = membership
    await server.set_serving(True)
    running = RunningRollout(server, engine, membership)
    try:
        await membership.register(config.register_timeout_seconds)
    except TimeoutError:
        await running.stop()
        raise
    membership.start_heartbeats()
    return running

