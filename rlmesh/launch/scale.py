"""Scaling the rollout instances: the scale file `rlmesh scale` writes and `rlmesh up` reads, and
which instances to drain and which to start to reach a count."""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from rlmesh.atomic_file import write_atomically

SCALE_FILE = "scale.json"
"""Written by `rlmesh scale` in the output folder: the number of rollout instances wanted."""


def request_scale(output_dir: Path, count: int) -> None:
    """Asks the mesh writing to `output_dir` for `count` rollout instances (written whole, then
    renamed into place, so the mesh never reads half a file)."""
    write_atomically(output_dir / SCALE_FILE, json.dumps({"rollout_instances": count}))


class ScaleRequests:
    """The requests of the scale file in `output_dir`, each read once (a new one is a newer file)."""

    def __init__(self, output_dir: Path) -> None:
        self.path = output_dir / SCALE_FILE
        self._seen = 0.0

    def new_request(self) -> int | None:
        """The count of a request not read before, or None; raises ValueError for a file that
        holds no count."""
        try:
            modified = self.path.stat().st_mtime
        except FileNotFoundError:
            return None
        if modified <= self._seen:
            return None
        self._seen = modified
        try:
            return int(json.loads(self.path.read_text())["rollout_instances"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"ignored {self.path}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class ScaleSteps:
    drain: tuple[int, ...]
    """Serving instances to drain: they hand their requests back with their tokens, then leave."""
    start: tuple[int, ...]
    """Indices to start new instances at."""


def plan_scale(serving: Collection[int], leaving: Collection[int], target: int, cap: int) -> ScaleSteps:
    """How to get from the `serving` instances to `target` of them: the highest indices drain; new
    instances take the lowest indices below `cap` that no serving or `leaving` instance holds (an
    instance still leaving keeps its port and namespace). While leaving instances hold the indices
    needed, fewer start than are missing: the rest start once those have left."""
    ordered = sorted(serving)
    taken = set(serving) | set(leaving)
    free = [index for index in range(cap) if index not in taken]
    return ScaleSteps(drain=tuple(ordered[target:]), start=tuple(free[: max(target - len(ordered), 0)]))
