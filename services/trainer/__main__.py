"""`python -m services.trainer --config trainer.toml`: train until the configured step count."""

import sys

from rlmesh.entrypoint import run_service
from services.trainer.config import TrainerConfig
from services.trainer.main import serve

if __name__ == "__main__":
    sys.exit(run_service("trainer", TrainerConfig, serve))
