"""Configuration of the manager: the settings a job sets (`rlmesh/settings/manager.py`) and the
wiring `rlmesh up` fills in (its socket, the journal's file, the weights service's address)."""

from __future__ import annotations

from pydantic import field_validator

from rlmesh.config import ServerConfig
from rlmesh.settings.manager import ManagerSettings, StalenessSetting


class ManagerConfig(ManagerSettings, StalenessSetting):
    server: ServerConfig = ServerConfig(port=50151)
    journal_path: str = ""
    """A SQLite file (WAL mode) recording accepted batches, every request's tokens so far, the
    groups sent, the published version and the instance registry: a manager restarted on it goes
    on where the killed one stopped. "" keeps everything in memory only."""
    weights_address: str = "127.0.0.1:50152"
    """The weights service: PublishVersion is accepted only for a version it holds."""
    gateway_port: int | None = None
    """The OpenAI-compatible gateway's HTTP port on the server's host (None: no gateway; 0: any free port)."""
    relay_addresses: list[str] = []
    """Relay shards (`python -m services.manager.relay`) to run training requests' streams through:
    their tokens go to the trainer past the manager, which keeps only their counts. Empty: the
    manager relays every token itself. From the environment: comma-separated."""
    model_dir: str = ""
    """The model folder whose tokenizer and chat template the gateway renders messages with."""

    @field_validator("relay_addresses", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        if isinstance(value, str):
            return [address.strip() for address in value.split(",") if address.strip()]
        return value
