"""The start-up check of a job's tasks against its model's tokenizer: each task is built (its data
read, its reward loaded, prompts rendered), so a bad task stops `rlmesh up` before any service
starts. `rlmesh up` forks it from the fork server, which has imported transformers already."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from rlmesh.lifecycle import name_process
from rlmesh.tasks.config import TaskConfig

CHECK_FAILED = 2
"""The exit code of a check that refused the job; its message is on stderr."""


def refusal(tasks: Sequence[TaskConfig], job_seed: int, model_dir: Path, search_path: Sequence[str]) -> str | None:
    """None when every task can run; else `rlmesh up`'s message naming the task and what is wrong."""
    from rlmesh.models.tokenizer import load_hf_tokenizer
    from rlmesh.tasks.build import build_task

    try:
        tokenizer = load_hf_tokenizer(model_dir)
        for task in tasks:
            # A remote verifier is not called here: its channel opens on the first score.
            built = build_task(task, tokenizer, job_seed, search_path)
            if built.reward is not None:
                asyncio.run(built.reward.close())
    except (ValueError, FileNotFoundError) as exc:  # ConfigError and TaskError are ValueErrors
        return f"rlmesh up: {exc}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlmesh.tasks.check", description=__doc__)
    parser.add_argument("--job", type=Path, required=True, help="the job as `rlmesh up` wrote it (job.json)")
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument(
        "--search-path", action="append", default=[], help="where reward modules are found (the job file's folder)"
    )
    args = parser.parse_args(argv)
    job = json.loads(args.job.read_text())
    message = refusal(
        [TaskConfig.model_validate(task) for task in job["tasks"]],
        job["algorithm"]["seed"],
        args.model_dir,
        args.search_path,
    )
    if message is not None:
        print(message, file=sys.stderr)
        return CHECK_FAILED
    return 0


if __name__ == "__main__":
    name_process("rlmesh-jobcheck")
    sys.exit(main())
