"""`python -m services.weights --config weights.toml`: start the weights service."""

import sys

from rlmesh.entrypoint import run_service
from services.weights.config import WeightsConfig
from services.weights.main import serve

if __name__ == "__main__":
    sys.exit(run_service("weights", WeightsConfig, serve))
