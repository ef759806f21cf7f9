"""Whole training runs for the benchmarks: `rlmesh up` as a real process on free ports, and what
it wrote (metrics.jsonl, summary.json)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rlmesh.launch.ports import free_base_port

ROOT = Path(__file__).resolve().parent.parent
START_ATTEMPTS = 3
"""Other processes of a shared machine may take one of the mesh's ports between the check and the bind."""
BIND_FAILED = "Failed to bind to address"


@dataclass
class TrainingRun:
    output_dir: Path
    records: list[dict]
    """metrics.jsonl: step records, held-out evaluations and checkpoint records, in order."""
    summary: dict
    process_seconds: float
    """The `rlmesh up` process from start to exit (services' start and stop included)."""

    @property
    def steps(self) -> list[dict]:
        """One record per training step, by step."""
        return [r for r in self.records if "step_seconds" in r]

    @property
    def evaluations(self) -> list[dict]:
        return [r for r in self.records if "eval/sampled_reward" in r]


def run_up(
    output_dir: Path,
    steps: int,
    settings: list[str],
    flags: list[str] = (),
    model_dir: Path | None = None,
    timeout: float = 3600,
) -> TrainingRun:
    """Runs `rlmesh up` (the default job unless `settings`, job fields as FIELD=VALUE, say otherwise)
    to the end; its console output goes to `<output_dir>/console.log`. A mesh that could not bind
    its ports starts again from scratch on others."""
    for attempt in range(1, START_ATTEMPTS + 1):
        output_dir.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable,
            "-m",
            "rlmesh.cli.main",
            "up",
            "--steps",
            str(steps),
            "--base-port",
            str(free_base_port()),
            "--output-dir",
            str(output_dir),
            *flags,
        ]
        if model_dir is not None:
            command += ["--model-dir", str(model_dir)]
        for setting in settings:
            command += ["--set", setting]
        console = output_dir / "console.log"
        started = time.monotonic()
        with console.open("w") as log:
            result = subprocess.run(
                command, check=False, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout
            )
        seconds = time.monotonic() - started
        if result.returncode == 0:
            break
        bind_failed = any(
            BIND_FAILED in service_log.read_text(errors="replace")
            for service_log in (output_dir / "logs").glob("*.log")
        )
        if not bind_failed or attempt == START_ATTEMPTS:
            tail = "\n".join(console.read_text().splitlines()[-30:])
            raise RuntimeError(f"`{' '.join(command)}` exited with {result.returncode}:\n{tail}")
        shutil.rmtree(output_dir)
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((output_dir / "summary.json").read_text())
    return TrainingRun(output_dir, records, summary, seconds)
