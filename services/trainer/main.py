"""Runs the trainer: wait for the manager and weights service, train, write the summary, exit.
The process exits 0 when training finished and 1 when it failed; SIGTERM stops it early."""

from __future__ import annotations

import asyncio
import sys

import structlog
import torch

from rlmesh.rpc import GrpcServer, stop_event_on_signals, wait_healthy
from rlmesh.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from services.trainer.config import TrainerConfig
from services.trainer.mesh import MeshClient
from services.trainer.server import TrainerServicer
from services.trainer.trainer import GrpoTrainer, TrainingStatus

log = structlog.get_logger()


async def serve(config: TrainerConfig) -> None:
    torch.set_num_threads(config.threads)
    stop = stop_event_on_signals()
    status = TrainingStatus(total_steps=config.steps, output_dir=config.output_dir)
    server = GrpcServer(config.server, [trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name])
    trainer_pb2_grpc.add_TrainerServiceServicer_to_server(TrainerServicer(status), server.server)
    await server.start()
    await server.set_serving(True)
    mesh = MeshClient(config.manager_address, config.weights_address, config.rpc_timeout_seconds)
    failed = False
    try:
        for address in (config.manager_address, config.weights_address):
            await wait_healthy(address, config.startup_timeout_seconds)
        trainer = GrpoTrainer(config, mesh, status)
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
    finally:
        await mesh.close()
        await server.stop()
    if failed:
        sys.exit(1)
