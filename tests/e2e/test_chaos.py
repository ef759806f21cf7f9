"""The chaos suite's short version: ten random faults (SIGKILL, SIGTERM or SIGSTOP of a rollout
instance, SIGKILL of the weights service mid-push or of the manager, a cut of a namespaced rollout
instance's link, an instance with a broken engine joining the pool), every kind at least once,
during a real training run with authorization on; it finishes, every accepted prompt is trained
exactly once, every cut instance rejoins and every broken one is quarantined. `make chaos` runs a
hundred."""

import subprocess
from pathlib import Path

import pytest

from bench.chaos import FAULT_WEIGHTS, run_chaos
from rlmesh.launch.netns import mesh_tag

pytestmark = pytest.mark.e2e


def test_ten_random_faults_lose_and_duplicate_nothing(model_dir, tmp_path):
    result = run_chaos(faults=10, seed=7, stop_seconds=12.0, steps_between_faults=2, output_dir=tmp_path / "run", model_dir=model_dir)
    assert result["faults_survived"] == 10
    assert result["prompts_accepted"] == result["steps"] * 16
    assert (result["samples_lost"], result["samples_duplicated"], result["groups_short"]) == (0, 0, 0)
    # Two faults may hit one process before its restart, so restarts can be fewer than faults.
    assert result["restarts_reported"] > 0
    # Network cuts need root; without it they are left out and the result says why.
    assert set(result["by_kind"]) | set(result["left_out"]) == set(FAULT_WEIGHTS)
    assert result["manager_restarts_reported"] == result["by_kind"]["kill_manager"]["faults"]
    assert result["cuts_not_rejoined"] == 0
    assert result["by_kind"]["broken_engine"]["faults"] >= 1 and result["broken_not_quarantined"] == 0
    if "cut_network" in result["by_kind"]:
        namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
        assert mesh_tag(tmp_path / "run") not in namespaces


def test_multi_turn_episodes_survive_random_faults(model_dir, tmp_path):
    """The multi-turn job (examples/feedback: two attempts per episode, each a session turn): every
    episode of every accepted group ends `done` and none is lost or trained twice."""
    job = Path(__file__).resolve().parents[2] / "examples" / "feedback" / "job.toml"
    result = run_chaos(faults=5, seed=11, stop_seconds=8.0, steps_between_faults=2, output_dir=tmp_path / "run", model_dir=model_dir,
                       job=job)
    assert result["faults_survived"] == 5
    assert (result["samples_lost"], result["samples_duplicated"], result["groups_short"]) == (0, 0, 0)
    assert result["episodes"] == result["prompts_accepted"] * 8 and result["episodes_not_done"] == 0
