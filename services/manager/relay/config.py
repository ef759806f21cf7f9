"""Configuration of a relay shard: the settings a job sets (`[relay]`, `rlmesh/settings/manager.py`)
and its socket, identity (the manager's: it calls instances as the manager does) and journal."""

from __future__ import annotations

from rlmesh.config import ServerConfig
from rlmesh.settings.manager import RelaySettings


class RelayConfig(RelaySettings):
    server: ServerConfig = ServerConfig(port=50157)
    journal_path: str = ""
    """An append-only file of the tokens the shard holds, written before each report: a shard
    restarted on it goes on with them, and the manager regenerates nothing. "" keeps them in memory
    only (a restarted shard's requests not yet delivered generate again)."""
