"""The chaos suite's short version: ten random faults (SIGKILL, SIGTERM or SIGSTOP of a rollout
instance, SIGKILL of the weights service mid-push, of the manager or of a relay shard, a cut of a
namespaced rollout instance's link, an instance with a broken engine joining the pool), every kind
at least once, during a real training run with authorization on, of the default task mixed with a
multi-turn one, with and without relay shards;
it finishes, every accepted prompt is trained exactly once, every episode ends done, every cut
instance rejoins and every broken one is quarantined. `make chaos` runs a hundred, on the default
job and on the multi-turn one."""

import subprocess

import pytest

from bench.chaos import FAULT_WEIGHTS, run_chaos
from rlmesh.launch.netns import mesh_tag

pytestmark = pytest.mark.e2e


MIXED_JOB = """
[[tasks]]
name = "increment"
kind = "increment"

[[tasks]]
name = "feedback"
kind = "increment"
weight = 0.25
eval.prompts = 8
eval.samples = 1
[tasks.environment]
builtin = "feedback"
max_turns = 2
"""
"""The default task beside a multi-turn one (two attempts per episode, each a session turn): one run
puts both paths through the faults."""


RELAYED_JOB = (
    MIXED_JOB
    + """
[mesh]
relay_shards = 2

[manager]
queue_ahead = 3

[rollout.engine]
max_batch_size = 32

[relay]
report_window_seconds = 0.5
"""
)
"""The same, its training tokens held by two relay shards past the manager (the multi-turn task's
turns keep the manager's own streams), run as the scale benchmark runs them: each instance given three
requests beyond its batch (of 32, which a step's 128 samples overflow), the shards' reports gathered
over half a second."""


@pytest.mark.parametrize("job_text", [MIXED_JOB, RELAYED_JOB], ids=["manager relays", "relay shards"])
def test_ten_random_faults_lose_and_duplicate_nothing(model_dir, tmp_path, job_text):
    job = tmp_path / "job.toml"
    job.write_text(job_text)
    result = run_chaos(
        faults=10,
        seed=7,
        stop_seconds=12.0,
        steps_between_faults=2,
        output_dir=tmp_path / "run",
        model_dir=model_dir,
        job=job,
    )
    assert result["faults_survived"] == 10
    assert result["prompts_accepted"] == result["steps"] * 16
    assert (result["samples_lost"], result["samples_duplicated"], result["groups_short"]) == (0, 0, 0)
    # Every episode of every accepted multi-turn group survived its faults.
    assert result["episodes"] > 0 and result["episodes_not_done"] == 0
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
