"""PPO with a critic survives a kill-and-resume: a trainer killed with SIGKILL after step 3, started
again by `rlmesh up` from the step-2 checkpoint, ends with the value model, the policy and their
optimizers bit for bit those of the same run left alone (at max_staleness 0 a run is deterministic)."""

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from rlmesh.launch.ports import free_base_port
from services.trainer.ranks.checkpoint import CRITIC
from tests.support.jobs import up_command
from tests.support.run_outputs import step_records_written, trainer_pid
from tests.support.waiting import wait_until

pytestmark = pytest.mark.e2e

STEPS = 4
KILLED_AFTER = 3


def start(model_dir: Path, output_dir: Path) -> subprocess.Popen:
    command = up_command(model_dir, output_dir, free_base_port(), steps=STEPS) + [
        "--max-staleness",
        "0",
        "--set",
        "algorithm.advantage_estimator=gae",
        "--set",
        "algorithm.prompts_per_step=4",
        "--set",
        "algorithm.group_size=4",
        "--set",
        "algorithm.checkpoint_every=2",
        "--set",
        "algorithm.eval_every=100",
        # Evaluations (at the start, on resuming, at the end) are no part of what is compared.
        "--set",
        "tasks.0.eval.prompts=1",
        "--set",
        "tasks.0.eval.samples=1",
        # One sequence at a time: a response's sampled tokens then do not depend on its batch-mates.
        "--set",
        "rollout.engine.max_batch_size=1",
    ]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(up: subprocess.Popen) -> str:
    console, _ = up.communicate(timeout=600)
    assert up.returncode == 0, console
    return console


def shards(output_dir: Path, step: int) -> list[dict]:
    """The shard files of a run's checkpoint of `step`, rank by rank."""
    checkpoint = output_dir / "checkpoints" / f"step_{step:06d}"
    return [torch.load(path, weights_only=True) for path in sorted(checkpoint.glob("shards_rank*.pt"))]


def differing(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor], keys: list[str]) -> list[str]:
    """Which of `keys` hold tensors that are not bit for bit equal."""
    return [key for key in keys if not torch.equal(left[key], right[key])]


def test_a_killed_critic_trainer_resumes_with_the_value_model_restored_bit_for_bit(model_dir, tmp_path):
    uninterrupted, killed = tmp_path / "uninterrupted", tmp_path / "killed"
    # Side by side: at max_staleness 0 neither run's result depends on the other's timing.
    reference, up = start(model_dir, uninterrupted), start(model_dir, killed)
    try:
        pid = wait_until(lambda: trainer_pid(killed), 120, "the trainer")
        wait_until(
            lambda: step_records_written(killed) >= KILLED_AFTER, 300, f"step {KILLED_AFTER} trained", interval=0.01
        )
        os.kill(pid, signal.SIGKILL)
        console = finish(up)
        assert "starting it again" not in finish(reference)
    finally:
        for process in (up, reference):
            if process.poll() is None:
                process.kill()
    assert console.count("trainer exited (killed by signal 9); starting it again") == 1, console
    ledger = [json.loads(line) for line in (killed / "rollouts.jsonl").read_text().splitlines() if line.strip()]
    assert [(r["step"], r["checkpoint"]) for r in ledger if r["event"] == "started"] == [(0, None), (2, "step_000002")]

    expected, resumed = shards(uninterrupted, STEPS), shards(killed, STEPS)
    assert expected and len(resumed) == len(expected)
    critic_keys = [key for key in expected[0]["tensors"] if key.startswith(CRITIC)]
    assert critic_keys, "the checkpoint holds no critic"
    # Steps 3 and 4 moved the value model: equal step-4 tensors are not those of a critic left as it was.
    assert differing(shards(uninterrupted, 2)[0]["tensors"], expected[0]["tensors"], critic_keys)
    for expected_shard, resumed_shard in zip(expected, resumed):
        assert expected_shard["tensors"].keys() == resumed_shard["tensors"].keys()
        critic_differs = differing(expected_shard["tensors"], resumed_shard["tensors"], critic_keys)
        assert not critic_differs, f"the value model or its optimizer differ: {len(critic_differs)} tensors"
        policy_differs = differing(expected_shard["tensors"], resumed_shard["tensors"], list(expected_shard["tensors"]))
        assert not policy_differs, f"the policy or its optimizer differ: {len(policy_differs)} tensors"
        assert torch.equal(expected_shard["rng"], resumed_shard["rng"])
