"""Fixtures of real gRPC servers on loopback port 0, started in-process from each service's own start()."""

from __future__ import annotations

import pytest
import pytest_asyncio
from google.protobuf.descriptor import ServiceDescriptor

from rlmesh.models.loading import load_causal_lm, trainable_tensors
from rlmesh.rollout.v1 import rollout_pb2_grpc
from rlmesh.rpc.channels import open_channel
from rlmesh.rpc.servers import GrpcServer
from services.manager.config import ManagerConfig
from services.manager.main import start as start_manager
from services.rollout.config import EngineConfig, RolloutConfig, TransferConfig
from services.rollout.main import start as start_rollout
from services.rollout.torch.engine import TorchEngine
from services.trainer.mesh import MeshClient
from tests.support.credentials import loopback
from tests.support.meshes import build_mesh, stop_mesh
from tests.support.tp_instances import TP, TpInstance


@pytest.fixture
async def scripted_server():
    """`await scripted_server(servicer, add_to_server, descriptor)`: the address of a real gRPC
    server on loopback answering with `servicer` (a test's own, scripted), stopped after the test."""
    servers = []

    async def start(servicer, add_to_server, service: ServiceDescriptor) -> str:
        server = GrpcServer(loopback(), [service.full_name])
        add_to_server(servicer, server.server)
        await server.start()
        servers.append(server)
        return server.address

    yield start
    for server in servers:
        await server.stop()


@pytest.fixture
async def grpc_mesh(model_dir):
    mesh = await build_mesh(model_dir, "grpc")
    yield mesh
    await stop_mesh(mesh)


@pytest.fixture
async def chat_mesh(chat_model_dir):
    """A mesh on the tiny chat model with the manager's gateway, and a trainer's client of it."""
    mesh = await build_mesh(chat_model_dir, "grpc", gateway=True)
    client = MeshClient(mesh.manager_address, mesh.weights_address, rpc_timeout=10)
    try:
        yield mesh, client
    finally:
        await client.close()
        await stop_mesh(mesh)


@pytest.fixture
async def channel_to():
    channels = []

    def open_(address: str):
        channel = open_channel(address)
        channels.append(channel)
        return channel

    yield open_
    for channel in channels:
        await channel.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def instance(model_dir):
    """A rollout instance split over TP rank processes behind its real gRPC server, registered at a
    manager, beside a one-process engine on the same weights; one per module, as pushes change it."""
    manager = await start_manager(ManagerConfig(server=loopback()))
    rollout = await start_rollout(
        RolloutConfig(
            server=loopback(),
            instance_id="tp-0",
            manager_address=manager.server.address,
            engine=EngineConfig(model_dir=str(model_dir), max_batch_size=64, tensor_parallel_size=TP),
            transfer=TransferConfig(mooncake=True, tcp=True),
            register_timeout_seconds=10,
        )
    )
    reference = TorchEngine(model_dir, max_batch_size=64)
    await reference.start()
    channel = open_channel(rollout.server.address)
    try:
        yield TpInstance(
            model_dir,
            rollout,
            rollout_pb2_grpc.RolloutServiceStub(channel),
            reference,
            trainable_tensors(load_causal_lm(model_dir)),
        )
    finally:
        await channel.close()
        await reference.stop()
        await rollout.stop()
        await manager.stop()
