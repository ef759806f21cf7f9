"""The chaos suite's short version: ten random faults (SIGKILL, SIGTERM or SIGSTOP of a rollout
instance, SIGKILL of the weights service mid-push) during a real training run; it finishes and
every accepted prompt is trained exactly once. `make chaos` runs a hundred."""

import pytest

from bench.chaos import run_chaos

pytestmark = pytest.mark.e2e


def test_ten_random_faults_lose_and_duplicate_nothing(model_dir, tmp_path):
    result = run_chaos(faults=10, seed=7, stop_seconds=12.0, steps_between_faults=2, output_dir=tmp_path / "run", model_dir=model_dir)
    assert result["faults_survived"] == 10
    assert result["prompts_accepted"] == result["steps"] * 16
    assert (result["samples_lost"], result["samples_duplicated"], result["groups_short"]) == (0, 0, 0)
    # Two faults may hit one process before its restart, so restarts can be fewer than faults.
    assert result["restarts_reported"] > 0
