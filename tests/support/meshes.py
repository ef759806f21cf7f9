"""In-process meshes: a manager, a weights service and rollout instances served from the test's
own process on loopback ports, and stopping them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rlmesh.config import TlsFiles
from services.manager.config import ManagerConfig
from services.manager.main import start as start_manager
from services.manager.relay.config import RelayConfig
from services.manager.relay.main import start as start_relay
from services.rollout.config import EngineConfig, RolloutConfig, TransferConfig
from services.rollout.main import start as start_rollout
from services.weights.config import WeightsConfig
from services.weights.main import start as start_weights
from tests.support.credentials import loopback


@dataclass
class Mesh:
    manager: object
    weights: object
    rollouts: list
    relays: list = field(default_factory=list)

    @property
    def manager_address(self) -> str:
        return self.manager.server.address

    @property
    def weights_address(self) -> str:
        return self.weights.server.address


def rollout_config(
    model_dir,
    manager_address: str,
    instance_id: str,
    mooncake: bool,
    max_batch_size: int = 64,
    tls: TlsFiles | None = None,
) -> RolloutConfig:
    return RolloutConfig(
        server=loopback(tls),
        instance_id=instance_id,
        manager_address=manager_address,
        engine=EngineConfig(model_dir=str(model_dir), max_batch_size=max_batch_size),
        transfer=TransferConfig(mooncake=mooncake),
        register_timeout_seconds=10,
    )


async def build_mesh(
    model_dir,
    backend: str,
    instances: int = 1,
    max_staleness: int = 0,
    lease_seconds: float = 10.0,
    max_batch_size: int = 64,
    weights_settings: dict | None = None,
    tls: Mapping[str, TlsFiles] | None = None,
    gateway: bool = False,
    relay_shards: int = 0,
    **manager_settings,
) -> Mesh:
    """A manager, a weights service and `instances` rollout instances, served from this process
    (with mutual TLS when `tls` gives each of them, by service name, its certificate); `gateway`:
    the manager serves its OpenAI gateway on a free port; `relay_shards`: relay shards hold the
    training tokens."""
    tls = tls or {}
    relays = [
        await start_relay(RelayConfig(server=loopback(tls.get("manager"), "manager"))) for _ in range(relay_shards)
    ]
    manager_settings.setdefault("relay_addresses", [relay.server.address for relay in relays])
    if gateway:
        manager_settings |= {"gateway_port": 0, "model_dir": str(model_dir)}
    manager = await start_manager(
        ManagerConfig(
            server=loopback(tls.get("manager"), "manager"),
            max_staleness=max_staleness,
            lease_seconds=lease_seconds,
            heartbeat_interval_seconds=min(2.0, lease_seconds / 4),
            **manager_settings,
        )
    )
    # The test process hosts the manager too: it must not run at background priority.
    weights = await start_weights(
        WeightsConfig(
            server=loopback(tls.get("weights")),
            manager_address=manager.server.address,
            backend=backend,
            poll_interval_seconds=0.2,
            retry_backoff_seconds=0.2,
            background_priority=False,
            **(weights_settings or {}),
        )
    )
    manager.stored_versions.weights_address = weights.server.address
    rollouts = [
        await start_rollout(
            rollout_config(
                model_dir,
                manager.server.address,
                f"instance-{i}",
                backend == "mooncake",
                max_batch_size,
                tls.get("rollout"),
            )
        )
        for i in range(instances)
    ]
    return Mesh(manager, weights, rollouts, relays)


async def stop_mesh(mesh: Mesh) -> None:
    for rollout in mesh.rollouts:
        await rollout.stop()
    await mesh.weights.stop()
    await mesh.manager.stop()
    for relay in mesh.relays:
        await relay.stop()
