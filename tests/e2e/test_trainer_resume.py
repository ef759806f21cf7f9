"""A trainer killed with SIGKILL at random points, once in the middle of a background checkpoint
write, is started again by `rlmesh up` and resumes: the ledger shows every accepted prompt trained
exactly once in the run that stands, none lost, none twice."""

import collections
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from rlmesh.launch.ports import free_base_port
from services.trainer.pipeline import load_pipeline
from services.trainer.ranks.checkpoint import latest_checkpoint
from tests.support.jobs import up_command
from tests.support.run_outputs import step_records_written, trainer_pid
from tests.support.waiting import wait_until

pytestmark = pytest.mark.e2e

STEPS = 48
PROMPTS = 8
KILLS = 6


def surviving_training(ledger: list[dict]) -> list[dict]:
    """The `trained` records of the run that stands: a trainer started at step s (from a checkpoint,
    or from scratch) undoes what was trained from step s on before it."""
    trained: list[dict] = []
    for record in ledger:
        if record["event"] == "started":
            trained = [t for t in trained if t["step"] < record["step"]]
        elif record["event"] == "trained":
            trained.append(record)
    return trained


def carries_accepted_and_in_flight(checkpoints: Path, read: dict[Path, bool]) -> bool:
    """Whether the newest complete checkpoint holds groups accepted for later steps and prompts
    still in flight. Polled every few milliseconds: a complete checkpoint does not change, so each
    is read once (`read` keeps the answers)."""
    checkpoint = latest_checkpoint(checkpoints)
    if checkpoint is None:
        return False
    if checkpoint not in read:
        plans = load_pipeline(checkpoint, {"increment": None})
        read[checkpoint] = any(p.waiting for p in plans) and any(p.outstanding for p in plans)
    return read[checkpoint]


def test_a_trainer_killed_anywhere_resumes_and_trains_every_prompt_exactly_once(model_dir, tmp_path):
    output_dir = tmp_path / "run"
    command = up_command(model_dir, output_dir, free_base_port(), steps=STEPS) + [
        "--max-staleness",
        "2",
        "--set",
        f"algorithm.prompts_per_step={PROMPTS}",
        "--set",
        "algorithm.group_size=4",
        "--set",
        "algorithm.checkpoint_every=2",
        "--set",
        "algorithm.eval_every=100",
        # Rollout slower than training, so checkpoints hold prompts in flight; a step trains once
        # all its groups are in, and groups of the next step finish meanwhile: accepted ahead.
        "--set",
        "rollout.engine.max_batch_size=8",
        "--set",
        "algorithm.micro_batch_groups=8",
    ]
    up = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rng = random.Random(13)
    kills = []
    try:
        for kill in range(KILLS):
            pid = wait_until(
                lambda: trainer_pid(output_dir) not in (None, *[k[0] for k in kills]) and trainer_pid(output_dir),
                120,
                "a new trainer",
            )
            progress = step_records_written(output_dir)
            # Killed only once it trained a step since it started: the run must get somewhere.
            wait_until(
                lambda progress=progress: step_records_written(output_dir) > progress,
                120,
                "a step trained since it started",
                interval=0.01,
            )
            if kill == 0:
                # Right after a checkpoint that carries both: the resume must restore them.
                read: dict[Path, bool] = {}
                wait_until(
                    lambda read=read: carries_accepted_and_in_flight(output_dir / "checkpoints", read),
                    120,
                    "a checkpoint holding accepted groups and prompts in flight",
                    interval=0.005,
                )
                os.kill(pid, signal.SIGKILL)
                kills.append((pid, "after a checkpoint carrying groups and prompts", True))
            elif kill == 2:
                # In the middle of a checkpoint's background write: its .partial folder is there.
                partial = wait_until(
                    lambda: next((output_dir / "checkpoints").glob("*.partial"), None),
                    120,
                    "a checkpoint being written",
                    interval=0.002,
                )
                os.kill(pid, signal.SIGKILL)
                kills.append((pid, "during a checkpoint write", partial.exists()))
            else:
                time.sleep(rng.uniform(0.0, 0.6))
                os.kill(pid, signal.SIGKILL)
                kills.append((pid, "at a random point", True))
        console, _ = up.communicate(timeout=600)
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode == 0, console
    assert console.count("trainer exited (killed by signal 9); starting it again") == KILLS, console
    assert all(still_writing for _, where, still_writing in kills if where.startswith("during")), kills

    ledger = [json.loads(line) for line in (output_dir / "rollouts.jsonl").read_text().splitlines() if line.strip()]
    starts = [r for r in ledger if r["event"] == "started"]
    assert len(starts) == KILLS + 1
    # The checkpoints carried rollouts already accepted for later steps and prompts in flight.
    assert sum(r["accepted_groups"] for r in starts) > 0 and sum(r["prompts_in_flight"] for r in starts) > 0
    trained = surviving_training(ledger)
    assert [t["step"] for t in trained] == list(range(STEPS))
    uids = collections.Counter(uid for t in trained for _, _, _, uid in t["prompts"])
    assert set(uids.values()) == {1}, f"trained twice: {[u for u, n in uids.items() if n > 1]}"
    assert set(uids) == {f"gen-{i}" for i in range(STEPS * PROMPTS)}, "a prompt was lost"
