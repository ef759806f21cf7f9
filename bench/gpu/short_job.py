"""The default job for a few steps through `rlmesh up`, trainer and rollout on the check's device:
with GRPO the reward must rise; with PPO and a critic the critic's figures must be finite."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

from rlmesh.launch.ports import free_base_port

WINDOW = 5
"""Steps averaged at each end of the run to say whether the reward rose."""
TRAINER_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
"""The trainer's torch.distributed backend, which puts its ranks on the device."""


CRITIC_FIGURES = ("critic/value_loss", "critic/explained_variance", "critic/values_mean")
"""What the trainer logs each step when it trains a critic (advantage_estimator gae)."""


def run_short_job(
    device: str, steps: int, output_dir: Path, settings: tuple[str, ...] = (), timeout: float = 300
) -> dict:
    """Mean reward of the first and the last WINDOW steps, step seconds, and `rises`; with a critic,
    its figures at the last step and whether all are finite. `settings` are extra `--set` lines."""
    command = [
        sys.executable,
        "-m",
        "rlmesh.cli.main",
        "up",
        "--steps",
        str(steps),
        "--output-dir",
        str(output_dir),
        "--base-port",
        str(free_base_port()),
        "--set",
        f"rollout.engine.device={device}",
        "--set",
        f"trainer.distributed_backend={TRAINER_BACKENDS[device]}",
    ]
    for setting in settings:
        command += ["--set", setting]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - started
    (output_dir / "up.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        return {
            "completed": False,
            "rises": False,
            "exit_code": result.returncode,
            "seconds": seconds,
            "error": (result.stdout + result.stderr)[-2000:],
        }
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in records if "reward" in r]
    step_seconds = sorted(r["step_seconds"] for r in records if "step_seconds" in r)
    window = min(WINDOW, len(rewards) // 2)
    first, last = sum(rewards[:window]) / window, sum(rewards[-window:]) / window
    figures = {
        "completed": len(rewards) == steps,
        "rises": last > first,
        "steps": len(rewards),
        "reward_first": first,
        "reward_last": last,
        "median_step_seconds": step_seconds[len(step_seconds) // 2],
        "seconds": seconds,
    }
    critic = [r for r in records if CRITIC_FIGURES[0] in r]
    if critic:
        figures["critic"] = {name: critic[-1][name] for name in CRITIC_FIGURES}
        figures["critic_steps"] = len(critic)
        figures["critic_finite"] = all(math.isfinite(r[name]) for r in critic for name in CRITIC_FIGURES)
    return figures
