"""The default job for a few steps through `rlmesh up`, trainer and rollout on the check's device;
the reward must rise."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from rlmesh.launch.ports import free_base_port

WINDOW = 5
"""Steps averaged at each end of the run to say whether the reward rose."""


def run_short_job(device: str, steps: int, output_dir: Path, timeout: float = 300) -> dict:
    """Mean reward of the first and the last WINDOW steps, step seconds, and `rises`."""
    command = [sys.executable, "-m", "rlmesh.cli", "up", "--steps", str(steps), "--output-dir", str(output_dir),
               "--base-port", str(free_base_port()), "--set", f"mesh.rollout_device={device}",
               "--set", f"mesh.trainer_device={device}"]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - started
    (output_dir / "up.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        return {"completed": False, "rises": False, "exit_code": result.returncode, "seconds": seconds,
                "error": (result.stdout + result.stderr)[-2000:]}
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in records if "reward" in r]
    step_seconds = sorted(r["step_seconds"] for r in records if "step_seconds" in r)
    first, last = sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW
    return {"completed": len(rewards) == steps, "rises": last > first, "steps": len(rewards), "reward_first": first,
            "reward_last": last, "median_step_seconds": step_seconds[len(step_seconds) // 2], "seconds": seconds}

