"""`rlmesh up` run again on the same output folder: the run resumes from the last checkpoint with
the task's cursor, and a checkpoint taken while the next steps were out carries their accepted
groups and prompts in flight into the resumed run."""

import json
import shutil
import subprocess

import pytest

from rlmesh.launch.ports import free_base_port
from tests.support.jobs import up_command

pytestmark = pytest.mark.e2e


def submitted_uids(ledger: list[dict]) -> dict[int, list[str]]:
    """Each step's prompts (by task position), from the last submission of the step."""
    return {r["step"]: [uid for _, uid in r["prompts"].values()] for r in ledger if r["event"] == "submitted"}


def run_up(model_dir, output_dir, steps: int) -> subprocess.CompletedProcess:
    command = up_command(model_dir, output_dir, free_base_port(), steps=steps) + [
        "--set",
        "algorithm.checkpoint_every=2",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_a_rerun_resumes_from_the_last_checkpoint_with_the_steps_that_were_out(model_dir, tmp_path):
    """A run of 2 steps, run again for 6, goes on from its last checkpoint with the task's cursor.
    With max_staleness 1, step 4 is drawn (and generated, or generating) when the checkpoint after
    step 4 is written: it keeps step 4's accepted groups and its prompts in flight, so a run resumed
    from it trains exactly those prompts, submitting again only the ones in flight, and draws step 5
    from the cursor as the first run did."""
    output_dir = tmp_path / "run"
    run_up(model_dir, output_dir, steps=2)
    run_up(model_dir, output_dir, steps=6)
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "reward" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["weight_version"] for r in records if "reward" in r] == [1, 2, 3, 4, 5, 6]
    ledger = [json.loads(line) for line in (output_dir / "rollouts.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in ledger if r["event"] == "submitted") == [0, 1, 2, 3, 4, 5]
    assert json.loads((output_dir / "summary.json").read_text())["steps"] == 6
    # The task's cursor came back with the checkpoint: the second run went on with the next prompts.
    first = submitted_uids(ledger)
    assert first == {step: [f"gen-{16 * step + i}" for i in range(16)] for step in range(6)}

    shutil.rmtree(output_dir / "checkpoints" / "step_000006")
    (output_dir / "rollouts.jsonl").unlink()
    run_up(model_dir, output_dir, steps=6)
    ledger = [json.loads(line) for line in (output_dir / "rollouts.jsonl").read_text().splitlines()]
    started = next(r for r in ledger if r["event"] == "started")
    assert started["step"] == 4 and started["accepted_groups"] + started["prompts_in_flight"] == 16
    trained = {r["step"]: sorted(uid for *_, uid in r["prompts"]) for r in ledger if r["event"] == "trained"}
    assert trained == {step: sorted(first[step]) for step in (4, 5)}
    assert all(r["batch_id"].endswith("-resumed") for r in ledger if r["event"] == "submitted" and r["step"] == 4)
