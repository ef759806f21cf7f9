"""mesh.json: what a running `rlmesh up` tells `rlmesh scale`, `rlmesh status` and the chaos suite
(its pid, the services with their pids and restarts, the rollout instances and their bounds, where
its role secrets are)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from rlmesh.atomic_file import write_atomically
from rlmesh.rpc.authz import Role
from rlmesh.rpc.credentials import secret_path

STATE_FILE = "mesh.json"
"""Written by `rlmesh up` in the output folder: its pid and the rollout instances, for `rlmesh scale`."""


def write_state(output_dir: Path, state: dict) -> None:
    """Written whole, then renamed into place: a reader never sees half a file."""
    write_atomically(output_dir / STATE_FILE, json.dumps(state, indent=2))


def find_running_mesh(runs: Path) -> Path | None:
    """The newest output folder under `runs` whose `rlmesh up` is still alive."""
    candidates = sorted(runs.glob(f"*/{STATE_FILE}"), key=lambda p: p.stat().st_mtime, reverse=True)
    for state in candidates:
        try:
            os.kill(json.loads(state.read_text())["pid"], 0)
        except (ProcessLookupError, KeyError, ValueError, PermissionError):
            continue
        return state.parent
    return None


def run_secret(run: Path, role: Role) -> Path | None:
    """`role`'s secret of the `rlmesh up` run in `run`: in the folder its mesh.json names (the
    run's own <run>/secrets unless it was given --secrets-dir); None if the run has none."""
    try:
        secrets = json.loads((run / STATE_FILE).read_text()).get("secrets_dir")
    except (OSError, ValueError):
        secrets = None
    path = secret_path(Path(secrets) if secrets else run / "secrets", role)
    return path if path.is_file() else None
