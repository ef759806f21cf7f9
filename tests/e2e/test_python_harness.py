"""A Python harness per episode, as a new user writes one (`python harness.py` with the official
`openai` client, about a CPU second to start), at the default job settings (16 prompts x 8
episodes a step) on this machine: a 6-step job runs by `rlmesh up --job` as real processes,
finishes, and no session is reaped for a slow start: every training episode ends `done`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlmesh.launch.ports import free_base_port
from rlmesh.models.chat_tiny import ChatModelSpec, create_chat_model
from tests.support.paths import REPO_ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.long]
"""About 800 interpreters start, each importing `openai` (a CPU second): some 15 minutes on 2 cores,
more than `make test` has; `make test-long` runs it, and CI after `make test`."""


HARNESS = '''
"""One chat turn about the row's increment problem, through the official openai client; the reward
is the share of the answer's characters the model got right, reported on stdout."""
import json
import os

from openai import OpenAI

row = json.loads(open(os.environ["RLMESH_ROW_FILE"]).read())
client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY: the episode's session on the gateway
reply = client.chat.completions.create(model="policy", max_tokens=12,
                                       messages=[{"role": "user", "content": row["prompt"]}])
text = (reply.choices[0].message.content or "").strip()
answer = row["answer"]
print(json.dumps({"reward": sum(a == b for a, b in zip(text, answer)) / max(len(text), len(answer))}))
'''

JOB = """
[[tasks]]
name = "harness"
kind = "increment"
sampling.max_tokens = 12
# Held-out episodes run beside the first step's (8 sampled, 8 greedy), at its start and the end.
eval.prompts = 8
eval.samples = 1

[tasks.environment]
command = "python harness.py"
max_turns = 2
"""
"""The default algorithm settings: 16 prompts a step, 8 episodes each; max_concurrent from the cores."""

STEPS = 6


@pytest.mark.timeout(2400)
def test_a_python_openai_harness_at_the_default_step_size_finishes_with_no_episode_reaped(tmp_path):
    model = create_chat_model(tmp_path / "model", ChatModelSpec(warmup_iterations=4, warmup_batch=4))
    (tmp_path / "harness.py").write_text(HARNESS)
    job = tmp_path / "job.toml"
    job.write_text(JOB)
    # `python` is the interpreter the job's harness finds first on PATH: this one, with `openai` installed.
    environment = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    output = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlmesh.cli.main",
            "up",
            "--job",
            str(job),
            "--output-dir",
            str(output),
            "--model-dir",
            str(model),
            "--base-port",
            str(free_base_port()),
            "--steps",
            str(STEPS),
        ],
        capture_output=True,
        text=True,
        timeout=2300,
        cwd=REPO_ROOT,
        env=environment,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == STEPS
    for record in steps:
        assert record["episodes/count"] == 16 * 8
        assert record["episodes/ended/done"] == 16 * 8, {
            k: v for k, v in record.items() if k.startswith("episodes/ended/")
        }
    assert [r["step"] for r in records if "eval/harness/sampled_reward" in r] == [0, STEPS]
    manager_log = (output / "logs" / "manager.log").read_text()
    assert "reaped" not in manager_log
