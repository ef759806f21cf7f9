"""`python -m services.rollout --config rollout.toml`: start one rollout instance."""

import sys

from rlmesh.entrypoint import run_service, until_signal
from services.rollout.config import RolloutConfig
from services.rollout.main import start

if __name__ == "__main__":
    sys.exit(run_service("rollout", RolloutConfig, until_signal(start)))
