"""Configuration of the weights service: the settings a job sets (`rlmesh/settings/weights.py`)
and the wiring `rlmesh up` fills in (its socket, the manager's address)."""

from __future__ import annotations

from rlmesh.config import ServerConfig
from rlmesh.settings.weights import CompressionMode, WeightsSettings


class WeightsConfig(WeightsSettings):
    server: ServerConfig = ServerConfig(port=50152, max_message_mb=64)
    manager_address: str = "127.0.0.1:50151"

    def link_mode(self, instance_id: str) -> CompressionMode:
        return self.link_compression.get(instance_id, self.compression)
