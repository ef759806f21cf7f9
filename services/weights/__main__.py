"""`python -m services.weights --config weights.toml`: start the weights service."""

import sys

from rlmesh.entrypoint import run_service, until_signal
from services.weights.config import WeightsConfig
from services.weights.main import start

if __name__ == "__main__":
    sys.exit(run_service("weights", WeightsConfig, until_signal(start)))
