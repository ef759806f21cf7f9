"""mesh.json: what a running `rlmesh up` tells `rlmesh scale`, `rlmesh status` and the chaos suite
(its pid, the services with their pids and restarts, the rollout instances and their bounds)."""

from __future__ import annotations

import json
import os
from pathlib import Path

STATE_FILE = "mesh.json"
"""Written by `rlmesh up` in the output folder: its pid and the rollout instances, for `rlmesh scale`."""


def write_state(output_dir: Path, state: dict) -> None:
    """Written whole, then renamed into place: a reader never sees half a file."""
    path = output_dir / STATE_FILE
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(state, indent=2))
    partial.replace(path)


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
