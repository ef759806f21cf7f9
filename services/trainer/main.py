"""Runs the trainer on every rank. Rank 0 serves TrainerService (health, reflection, status),
waits for the manager and weights service, drives training, writes the summary and exits; the
other ranks follow rank 0's commands until it tells them to stop. The process exits 0 when
training finished and 1 when it failed; SIGTERM stops it early."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import structlog
import torch

from rlmesh.rpc.channels import open_channel, wait_healthy
from rlmesh.rpc.servers import GrpcServer, stop_event_on_signals
from rlmesh.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from rlmesh.weights.v1 import weights_pb2_grpc
from services.trainer.config import TrainerConfig
from services.trainer.loop import TrainingLoop, TrainingStatus
from services.trainer.mesh import MeshClient
from services.trainer.ranks.commands import RankGroup
from services.trainer.ranks.distributed import (
    RankInfo,
    TorchThread,
    die_with_agent,
    init_distributed,
    shutdown_distributed,
)
from services.trainer.ranks.handoff import ShardHandoff, mesh_tag
from services.trainer.ranks.policy import ShardedPolicy
from services.trainer.server import TrainerServicer

log = structlog.get_logger()

ERROR_FILE = "error.txt"
"""Written to the output folder when training fails: why."""


async def serve(config: TrainerConfig) -> None:
    torch.set_num_threads(config.threads)
    die_with_agent()
    rank = await asyncio.to_thread(init_distributed, config.distributed_backend, config.collective_timeout_seconds)
    structlog.contextvars.bind_contextvars(rank=rank.rank, world_size=rank.world_size)
    log.info("rank started", device=str(rank.device), pid=os.getpid())
    if rank.is_leader:
        await lead(config, rank)
    else:
        await follow(config, rank)


async def _build(config: TrainerConfig, rank: RankInfo, thread: TorchThread) -> tuple[RankGroup, object]:
    policy = await thread.run(ShardedPolicy, config, rank)
    channel = open_channel(config.weights_address)
    handoff = ShardHandoff(
        weights_pb2_grpc.WeightsServiceStub(channel),
        policy.shape,
        rank.rank,
        rank.world_size,
        config.handoff,
        mesh_tag(config.output_dir),
        config.upload_timeout_seconds,
        policy.weights_dtype,
    )
    return RankGroup(
        rank, policy, handoff, thread, Path(config.output_dir) / "checkpoints", config.publish_timeout_seconds
    ), channel


async def lead(config: TrainerConfig, rank: RankInfo) -> None:
    stop = stop_event_on_signals()
    status = TrainingStatus(total_steps=config.steps, output_dir=config.output_dir)
    server = GrpcServer(config.server, [trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name])
    servicer = TrainerServicer(status)
    trainer_pb2_grpc.add_TrainerServiceServicer_to_server(servicer, server.server)
    await server.start()
    await server.serve_metrics("trainer", servicer.collect_metrics)
    await server.set_serving(True)
    Path(config.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(config.output_dir) / ERROR_FILE).unlink(missing_ok=True)
    mesh = MeshClient(
        config.manager_address, config.weights_address, config.rpc_timeout_seconds, config.manager_outage_seconds
    )
    thread = TorchThread()
    group, channel = None, None
    failed = False
    try:
        group, channel = await _build(config, rank, thread)
        for address in (config.manager_address, config.weights_address):
            await wait_healthy(address, config.startup_timeout_seconds)
        trainer = TrainingLoop(config, mesh, status, group)
        training = asyncio.create_task(trainer.run())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({training, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not training.done():
            log.warning("stopped before training finished", step=status.step)
            training.cancel()
            failed = True
        else:
            summary = training.result()
            status.phase = trainer_pb2.PHASE_FINISHED
            log.info("training finished", steps=summary["steps"], start=summary["start"], end=summary["end"])
        stopping.cancel()
    except Exception as exc:
        failed = True
        status.phase = trainer_pb2.PHASE_FAILED
        status.error = f"{type(exc).__name__}: {exc}"
        log.exception("training failed")
        # `rlmesh up` shows the reason from here: the process is gone before anyone asks it.
        (Path(config.output_dir) / ERROR_FILE).write_text(status.error + "\n")
    finally:
        # The other ranks exit when told to stop; if they are mid-command they cannot hear it, and
        # this rank's exit makes torchrun stop them.
        told = False
        if group is not None and not stop.is_set():
            try:
                told = await asyncio.wait_for(group.stop(), timeout=config.rpc_timeout_seconds)
            except Exception as exc:  # noqa: BLE001 - the process is ending either way
                log.warning("could not tell the other ranks to stop", error=str(exc))
        if group is not None:
            group.handoff.close()
        if channel is not None:
            await channel.close()
        await mesh.close()
        await server.stop()
        thread.close()
        if told and not failed:
            shutdown_distributed()
    if failed:
        sys.exit(1)


async def follow(config: TrainerConfig, rank: RankInfo) -> None:
    thread = TorchThread()
    group, channel = await _build(config, rank, thread)

    def terminate(signum, frame) -> None:
        # Blocked in a collective waiting for rank 0's next command, this rank cannot unwind:
        # free its shared memory and go.
        group.handoff.close()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, terminate)
    try:
        await group.follow()
        log.info("stopped by rank 0")
    finally:
        group.handoff.close()
        await channel.close()
        thread.close()
    shutdown_distributed()
