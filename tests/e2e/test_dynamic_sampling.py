"""DAPO's dynamic sampling on the real mesh: groups whose rewards are all equal are dropped and
refilled within their step, so every step trains on a full batch of groups that teach something."""

import json
import subprocess

import pytest

from rlmesh.launch.ports import free_base_port
from tests.support.jobs import up_command

pytestmark = pytest.mark.e2e

REWARD = """
def score(completion):
    return float(len(completion) % 2)
"""
"""A coin per sample: a group of two is all-equal half the time."""

JOB = """
[[tasks]]
name = "parity"
kind = "increment"
reward.function = "reward:score"

[algorithm]
group_size = 2
dynamic_sampling = true
"""


def test_groups_with_equal_rewards_are_dropped_and_refilled_within_their_step(model_dir, tmp_path):
    (tmp_path / "reward.py").write_text(REWARD)
    (tmp_path / "job.toml").write_text(JOB)
    output_dir = tmp_path / "run"
    command = up_command(model_dir, output_dir, free_base_port(), steps=3) + ["--job", str(tmp_path / "job.toml")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    ledger = [json.loads(line) for line in (output_dir / "rollouts.jsonl").read_text().splitlines()]
    accepted = {(r["batch_id"], r["prompt_id"]): r for r in ledger if r["event"] == "accepted"}
    dropped = [r for r in ledger if r["event"] == "dropped"]
    assert dropped and all(len(set(r["rewards"])) == 1 for r in dropped)
    trained = [r for r in ledger if r["event"] == "trained"]
    assert [t["step"] for t in trained] == [0, 1, 2]
    for step in trained:
        groups = [accepted[(batch_id, prompt_id)] for batch_id, prompt_id, _, _ in step["prompts"]]
        assert len(groups) == 16 and all(len(set(g["rewards"])) == 2 for g in groups)
    uids = [uid for t in trained for _, _, _, uid in t["prompts"]]
    assert len(set(uids)) == len(uids) and not {r["uid"] for r in dropped} & set(uids)
    metrics = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("dropped_groups", 0) for r in metrics) == len(dropped)
