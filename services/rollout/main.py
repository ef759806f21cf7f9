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
from rlmesh.rpc.servers import GrpcServer
from services.rollout.config import RolloutConfig
from services.rollout.engine import Engine, TensorParallelEngine
from services.rollout.membership import Membership
from services.rollout.server import RolloutServicer
from services.rollout.torch.rank import RankTransfer, RankWeights
from services.rollout.weight_update import Backend, WeightUpdater

log = structlog.get_logger()


def rank_transfer(config: RolloutConfig) -> RankTransfer:
    return RankTransfer(
        host=config.server.host,
        advertise_host=config.server.advertised_host,
        mooncake=config.transfer.mooncake,
        mooncake_protocol=config.transfer.mooncake_protocol,
        tcp=config.transfer.tcp,
        background=config.transfer.background_priority,
        catch_up_delay_seconds=config.transfer.catch_up_delay_seconds,
    )


def build_engine(config: RolloutConfig) -> Engine:
    engine = config.engine
    if engine.kind == "synthetic":
        from services.rollout.synthetic_engine import SyntheticEngine

        return SyntheticEngine(
            engine.synthetic, engine.max_batch_size, engine.model_dir or None, update_mode=engine.update_mode
        )
    if engine.kind == "vllm":
        from services.rollout.vllm_engine import VllmEngine

        return VllmEngine(
            engine.model_dir, engine.max_batch_size, engine.seed, engine.vllm, update_mode=engine.update_mode
        )
    from services.rollout.torch.engine import TorchEngine

    return TorchEngine(
        engine.model_dir,
        engine.max_batch_size,
        engine.seed,
        tensor_parallel_size=engine.tensor_parallel_size,
        transfer=rank_transfer(config),
        threads=engine.threads,
        update_mode=engine.update_mode,
        stream_interval=engine.stream_interval,
        device=engine.device,
        dtype=engine.dtype,
        prefix_cache_bytes=int(engine.prefix_cache_mib * (1 << 20)),
    )


def build_updater(config: RolloutConfig, engine: Engine) -> WeightUpdater:
    offered = {"grpc": True, "mooncake": config.transfer.mooncake, "tcp": config.transfer.tcp}
    backends: frozenset[Backend] = frozenset(name for name, on in offered.items() if on)
    pause_limit = config.engine.update_pause_limit_seconds
    if isinstance(engine, TensorParallelEngine):
        return WeightUpdater(engine, engine.ranks, backends, pause_limit=pause_limit)
    # Engines that take full tensors receive them here, in the service process.
    return WeightUpdater(
        engine, [RankWeights(0, rank_transfer(config))], backends, owns_ranks=True, pause_limit=pause_limit
    )


@dataclass(slots=True)
class RunningRollout:
    server: GrpcServer
    engine: Engine
    servicer: RolloutServicer
    membership: Membership
    drain_timeout: float
    server_loop: asyncio.AbstractEventLoop
    stop_requested: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the instance was told to leave (a preemption notice, a failed engine): the process then stops."""
    _drained: int | None = None
    _leaving: asyncio.Future[int] | None = None

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
        if self.engine.held_for_update:
            await self.engine.release_update_hold()
        self._drained = self.engine.abort()
        deadline = time.monotonic() + self.drain_timeout
        while self.servicer.open_responses and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await self.membership.deregister()
        log.info("drained", handed_back_requests=self._drained, streams_left=self.servicer.open_responses)
        self.stop_requested.set()
        return self._drained

    def engine_failed(self, reason: str) -> None:
        """From any thread: an engine that can no longer serve takes its instance out of the pool."""

        def leave() -> None:
            self._leaving = asyncio.ensure_future(self.drain(f"engine failed: {reason}"))

        self.server_loop.call_soon_threadsafe(leave)

    async def stop(self) -> None:
        await self.drain("shutting down")
        await self.server.stop()
        await self.engine.stop()
        self.servicer.updater.close()


async def start(config: RolloutConfig) -> RunningRollout:
    structlog.contextvars.bind_contextvars(instance_id=config.instance_id)
    torch.set_num_threads(config.engine.threads)
    engine = build_engine(config)
    try:
        updater = build_updater(config, engine)
        model_name = Path(config.engine.model_dir).name if config.engine.model_dir else "synthetic"
        servicer = RolloutServicer(
            config.instance_id, model_name, config.engine.kind, engine, updater, config.preemptible
        )
        server = GrpcServer(config.server, [rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name])
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server.server)
        await engine.start()
        await server.start()
        await server.serve_metrics("rollout", servicer.collect_metrics)
    except BaseException:
        # A tensor-parallel engine's worker processes must not outlive a failed start.
        await engine.stop()
        raise
    membership = Membership(
        config.manager_address,
        config.instance_id,
        server.address,
        engine,
        config.rpc_timeout_seconds,
        config.preemptible,
        config.engine.saturation_batch_size,
    )
    servicer.membership = membership
    await server.set_serving(True)
    running = RunningRollout(
        server, engine, servicer, membership, config.drain_timeout_seconds, asyncio.get_running_loop()
    )
    servicer.drain = running.drain
    engine.on_failure = running.engine_failed
    try:
        await membership.register(config.register_timeout_seconds)
    except TimeoutError:
        await running.stop()
        raise
    membership.start_heartbeats()
    return running
