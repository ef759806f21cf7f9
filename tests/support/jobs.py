"""What starts a run: `rlmesh up` command lines and job files with a dataset task."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.support.credentials import TEST_SECRETS


def up_command(model_dir: Path, output_dir: Path, base_port: int, steps: int) -> list[str]:
    """A short run: held-out validation every 2 steps, of 4 prompts with one sampled response each
    (what the checks need: the figures are filed, not how good they are)."""
    return [
        sys.executable,
        "-m",
        "rlmesh.cli.main",
        "up",
        "--steps",
        str(steps),
        "--base-port",
        str(base_port),
        "--model-dir",
        str(model_dir),
        "--output-dir",
        str(output_dir),
        "--secrets-dir",
        str(TEST_SECRETS),
        "--set",
        "algorithm.eval_every=2",
        "--set",
        "tasks.0.eval.prompts=4",
        "--set",
        "tasks.0.eval.samples=1",
    ]


def dataset_job(folder: Path, extra: str = "", fields: str = '{ answer = "solution" }') -> Path:
    """job.toml in `folder` with one dataset task: data.jsonl of 20 rows, a reward in my_reward.py
    beside it, `fields` mapping the rows' fields, 4 rows held out, and `extra` TOML appended."""
    (folder / "data.jsonl").write_text(
        "".join(json.dumps({"question": f"{i}=", "solution": str(i)}) + "\n" for i in range(20))
    )
    (folder / "my_reward.py").write_text("def score(completion, answer):\n    return float(completion == answer)\n")
    job = folder / "job.toml"
    job.write_text(f"""
[[tasks]]
name = "mine"
prompt.template = "{{question}}"
reward.function = "my_reward:score"
[tasks.dataset]
path = "data.jsonl"
fields = {fields}
[tasks.eval]
holdout = 4
{extra}
""")
    return job
