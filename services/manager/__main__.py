"""`python -m services.manager --config manager.toml`: start the manager."""

import sys

from rlmesh.entrypoint import run_service
from services.manager.config import ManagerConfig
from services.manager.main import serve

if __name__ == "__main__":
    sys.exit(run_service("manager", ManagerConfig, serve))
