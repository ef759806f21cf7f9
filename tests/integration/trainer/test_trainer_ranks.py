"""The trainer's ranks as processes: the shared-memory slots of a dead rank process are removed
(only its own mesh's, only its rank's), and `rlmesh up` refuses a trainer of no ranks."""

from __future__ import annotations

import os
import subprocess
import sys

from rlmesh.transfer.shards import SHM_DIR
from services.trainer.ranks.handoff import mesh_tag, remove_stale_slots, slot_name


def test_slots_of_dead_processes_of_the_same_mesh_are_removed(tmp_path):
    mesh = mesh_tag(str(tmp_path))
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    stale = SHM_DIR / slot_name(mesh, int(dead), 0, 0)
    mine = SHM_DIR / slot_name(mesh, os.getpid(), 0, 1)
    other_rank = SHM_DIR / slot_name(mesh, int(dead), 1, 0)
    other_mesh = SHM_DIR / slot_name("0" * 10, int(dead), 0, 0)
    for path in (stale, mine, other_rank, other_mesh):
        path.write_bytes(b"x")
    try:
        assert remove_stale_slots(mesh, 0) == [stale.name]
        assert not stale.exists() and mine.exists() and other_rank.exists() and other_mesh.exists()
    finally:
        for path in (mine, other_rank, other_mesh):
            path.unlink(missing_ok=True)


def test_up_refuses_a_trainer_of_no_ranks():
    result = subprocess.run(
        [sys.executable, "-m", "rlmesh.cli.main", "up", "--trainer-ranks", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "--trainer-ranks: must be at least 1" in result.stderr
