"""Configuration of a relay shard: its socket and identity (the manager's: it calls instances as the
manager does), and how often it reports progress to the manager's ledger."""

from __future__ import annotations

from pydantic import Field

from rlmesh.config import ServerConfig, StrictModel


class RelayConfig(StrictModel):
    server: ServerConfig = ServerConfig(port=50157)
    journal_path: str = ""
    """An append-only file of the tokens the shard holds, written before each report: a shard
    restarted on it goes on with them, and the manager regenerates nothing. "" keeps them in memory
    only (a restarted shard's requests not yet delivered generate again)."""
    generate_timeout_seconds: float = Field(default=600.0, gt=0)
    """Deadline of one GenerateMany stream to an instance (the manager's setting of that name)."""
    progress_seconds: float = Field(default=1.0, gt=0)
    """How often the token counts of running requests reach the manager: its balance and tail rules
    read them. Finished and ended attempts are reported at once."""
    report_window_seconds: float = Field(default=0.05, ge=0)
    """How long a report waits for more finishes to travel with it: the manager dispatches once per
    report, so a wider window costs it less and a freed slot waits longer for its next request."""
