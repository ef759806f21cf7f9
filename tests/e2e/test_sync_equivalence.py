"""At max_staleness 0 the asynchronous schedule is synchronous RL exactly: with the same seed, `rlmesh
up` gives bit for bit the metrics of the plain loop (generate the step's batch, then train)."""

import json
import subprocess
from pathlib import Path

import pytest

from rlmesh.launch.ports import free_base_port
from tests.support.jobs import up_command

pytestmark = pytest.mark.e2e

TIMING = {
    "time",
    "step_seconds",
    "generated_tokens_per_second",
    "publish_seconds",
    "publish_upload_seconds",
    "publish_pack_seconds",
    "rollout_wait_seconds",
    "checkpoint_seconds",
    "eval/seconds",
}
"""Wall-clock figures: the only metrics two runs may differ in."""


def run(model_dir: Path, output_dir: Path, schedule: str) -> list[dict]:
    command = up_command(model_dir, output_dir, free_base_port(), steps=3) + [
        "--max-staleness",
        "0",
        "--set",
        f"algorithm.schedule={schedule}",
        "--set",
        "algorithm.prompts_per_step=8",
        "--set",
        "algorithm.group_size=4",
        "--set",
        "algorithm.micro_batch_groups=2",
        "--set",
        "algorithm.mini_batches_per_step=2",
        # One sequence at a time: a response's logprobs then do not depend on its batch-mates. Two
        # instances: groups finish in an order that differs from run to run.
        "--set",
        "rollout.engine.max_batch_size=1",
        "--rollout-instances",
        "2",
        # Held-out validation on the trainer's policy: a background one is skipped when a newer
        # version supersedes its own before its requests are dispatched, which is timing too.
        "--set",
        "algorithm.validation=inline",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    records = [{k: v for k, v in r.items() if k not in TIMING and not k.startswith("balance/")} for r in records]
    return [r for r in records if len(r) > 1]


def test_the_async_schedule_at_staleness_zero_is_the_synchronous_loop_bit_for_bit(model_dir, tmp_path):
    pipelined = run(model_dir, tmp_path / "async", "async")
    synchronous = run(model_dir, tmp_path / "sync", "sync")
    trained = [r for r in pipelined if "loss" in r]
    assert [r["step"] for r in trained] == [1, 2, 3]
    assert all(r["staleness_max"] == 0 and r["staleness_violations"] == 0 for r in trained)
    # Training moved the policy (a check that compares nothing would pass too).
    assert len({r["loss"] for r in trained}) == 3
    for mine, reference in zip(pipelined, synchronous, strict=True):
        assert mine == reference, f"step {mine['step']}: " + ", ".join(
            f"{k}: {mine.get(k)!r} != {reference.get(k)!r}"
            for k in sorted(set(mine) | set(reference))
            if mine.get(k) != reference.get(k)
        )
