"""`rlmesh up` run again on the same output folder: the run resumes from the last checkpoint with
the task's cursor, and a checkpoint taken while the next steps were out carries their accepted
groups and prompts in flight into the resumed run."""

import json
import shutil
import subprocess

import pytest

from rlmesh.launch.ports import free_base_port
from tests.support import up_command

pytestmark = pytest.mark.e2e


def test_a_rerun_resumes_from_the_last_checkpoint(model_dir, tmp_path):
    output_dir = tmp_path / "run"
    for steps in (2, 4):
        result = subprocess.run(up_command(model_dir, output_dir, free_base_port(), steps=steps),
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "reward" in r] == [1, 2, 3, 4]
    assert [r["weight_version"] for r in records if "reward" in r] == [1, 2, 3, 4]
    ledger = [json.loads(line) for line in (output_dir / "rollouts.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in ledger if r["event"] == "submitted") == [0, 1, 2, 3]
    assert json.loads((output_dir / "summary.json").read_text())["steps"] == 4
    # The task's cursor came back with the checkpoint: the second run went on with the next prompts.
    assert submitted_uids(ledger) == {step: [f"gen-{16 * step + i}" for i in range(16)] for step in range(4)}


def submitted_uids(ledger: list[dict]) -> dict[int, list[str]]:
    """Each step's prompts (by task position), from the last submission of the step."""
    return {r["step"]: [uid for _, uid in r["prompts"].values()] for r in ledger if r["event"] == "submitted"}


def test_a_checkpoint_taken_while_the_next_steps_were_out_carries_them_into_the_resumed_run(model_dir, tmp_path):
    """With max_staleness 1, step 2 is drawn (and generated, or generating) when the checkpoint
    after step 2 is written: it keeps step 2's accepted groups and its prompts in flight, so a run
    resumed from it trains exactly those prompts, submitting again only the ones in flight, and
    draws step 3 from the cursor as the first run did."""
    output_dir = tmp_path / "run"
    command = up_command(model_dir, output_dir, free_base_port(), steps=4) + ["--set", "algorithm.checkpoint_every=2"]
    assert subprocess.run(command, capture_output=True, text=True, timeout=600).returncode == 0
    first = submitted_uids([json.loads(line) for line in (output_dir / "rollouts.jsonl").read_text().splitlines()])
    shutil.rmtree(output_dir / "checkpoints" / "step_000004")
    (output_dir / "rollouts.jsonl").unlink()
    command = up_command(model_dir, output_dir, free_base_port(), steps=4) + ["--set", "algorithm.checkpoint_every=2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    ledger = [json.loads(line) for line in (output_dir / "rollouts.jsonl").read_text().splitlines()]
    started = next(r for r in ledger if r["event"] == "started")
    assert started["step"] == 2 and started["accepted_groups"] + started["prompts_in_flight"] == 16
    trained = {r["step"]: sorted(uid for *_, uid in r["prompts"]) for r in ledger if r["event"] == "trained"}
    assert trained == {step: sorted(first[step]) for step in (2, 3)}
    assert all(r["batch_id"].endswith("-resumed") for r in ledger if r["event"] == "submitted" and r["step"] == 2)
