"""`python -m services.manager --config manager.toml`: start the manager."""

import sys

from rlmesh.entrypoint import run_service, until_signal
from services.manager.config import ManagerConfig
from services.manager.main import start

if __name__ == "__main__":
    sys.exit(run_service("manager", ManagerConfig, until_signal(start)))
