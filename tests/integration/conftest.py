"""Real gRPC servers on loopback port 0, started in-process from each service's own start()."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlmesh.config import ServerConfig
from rlmesh.launch.ports import free_port
from rlmesh.launch.processes import Child, spawn_service
from rlmesh.rpc import open_channel
from services.manager.config import ManagerConfig
from services.manager.main import start as start_manager
from services.rollout.config import EngineConfig, RolloutConfig, TransferConfig
from services.rollout.main import start as start_rollout
from services.weights.config import WeightsConfig
from services.weights.main import start as start_weights


def loopback() -> ServerConfig:
    return ServerConfig(host="127.0.0.1", port=0, grace_seconds=0.5)


@dataclass
class Mesh:
    manager: object
    weights: object
    rollouts: list

    @property
    def manager_address(self) -> str:
        return self.manager.server.address

    @property
    def weights_address(self) -> str:
        return self.weights.server.address


async def wait_for(predicate, timeout: float = 20.0, interval: float = 0.05):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(interval)


def rollout_config(model_dir, manager_address: str, instance_id: str, mooncake: bool, max_batch_size: int = 64) -> RolloutConfig:
    return RolloutConfig(
        server=loopback(),
        instance_id=instance_id,
        manager_address=manager_address,
        engine=EngineConfig(model_dir=str(model_dir), max_batch_size=max_batch_size),
        transfer=TransferConfig(mooncake=mooncake),
        register_timeout_seconds=10,
    )


async def build_mesh(model_dir, backend: str, instances: int = 1, max_staleness: int = 0, lease_seconds: float = 10.0,
                     max_batch_size: int = 64, weights_settings: dict | None = None, **manager_settings) -> Mesh:
    manager = await start_manager(ManagerConfig(server=loopback(), max_staleness=max_staleness, lease_seconds=lease_seconds,
                                                heartbeat_interval_seconds=min(2.0, lease_seconds / 4), **manager_settings))
    # The test process hosts the manager too: it must not run at background priority.
    weights = await start_weights(WeightsConfig(server=loopback(), manager_address=manager.server.address, backend=backend,
                                                poll_interval_seconds=0.2, retry_backoff_seconds=0.2, background_priority=False,
                                                **(weights_settings or {})))
    rollouts = [
        await start_rollout(rollout_config(model_dir, manager.server.address, f"instance-{i}", backend == "mooncake", max_batch_size))
        for i in range(instances)
    ]
    return Mesh(manager, weights, rollouts)


async def stop_mesh(mesh: Mesh) -> None:
    for rollout in mesh.rollouts:
        await rollout.stop()
    await mesh.weights.stop()
    await mesh.manager.stop()


@pytest.fixture
async def grpc_mesh(model_dir):
    mesh = await build_mesh(model_dir, "grpc")
    yield mesh
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


def spawn_rollout(log_dir, manager_address: str, instance_id: str, **settings: str) -> Child:
    """A rollout instance as a real process; `settings` are RolloutConfig fields by their
    environment names without the prefix (ENGINE__KIND="synthetic")."""
    port = free_port()
    env = {
        "RLMESH_ROLLOUT_SERVER__HOST": "127.0.0.1",
        "RLMESH_ROLLOUT_SERVER__PORT": str(port),
        "RLMESH_ROLLOUT_INSTANCE_ID": instance_id,
        "RLMESH_ROLLOUT_MANAGER_ADDRESS": manager_address,
        "RLMESH_ROLLOUT_TRANSFER__MOONCAKE": "false",
        **{f"RLMESH_ROLLOUT_{key}": value for key, value in settings.items()},
    }
    return spawn_service(instance_id, "services.rollout", f"127.0.0.1:{port}", env, Path(log_dir), mesh_id=str(log_dir))
