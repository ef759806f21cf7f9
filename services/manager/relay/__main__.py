"""`python -m services.manager.relay --config relay.toml`: start a relay shard."""

import sys

from rlmesh.entrypoint import run_service, until_signal
from services.manager.relay.config import RelayConfig
from services.manager.relay.main import start

if __name__ == "__main__":
    sys.exit(run_service("relay", RelayConfig, until_signal(start)))
