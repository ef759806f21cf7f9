"""Multi-turn jobs run by `rlmesh up --job` as real processes: a Python environment in the user's own
file drives episodes through the manager's sessions, the trainer trains them, and the figures of
episodes (turns, tokens by source, how they ended) and of held-out episodes are filed; an
environment written for verifiers (a tool environment with its own rows) runs unchanged through
the adapter and its episodes train."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlmesh.launch.ports import free_base_port
from rlmesh.models.chat_tiny import ChatModelSpec, create_chat_model
from tests.support.paths import REPO_ROOT

pytestmark = pytest.mark.e2e


ENVIRONMENT = '''
import asyncio


class Echo:
    """Two turns: the reward is whether the model's second turn repeats its first."""

    def __init__(self):
        self.turns = []

    def reset(self, row):
        return [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": row["prompt"]}]

    async def step(self, action):
        await asyncio.sleep(0.01)
        self.turns.append(action.text)
        if len(self.turns) == 1:
            return "Say that again.", 0.0, False
        return None, float(self.turns[0] == self.turns[1]), True
'''


VERIFIERS_ENVIRONMENT = '''
"""A verifiers (0.4) tool environment, as its users write one: rows of sums, an adding tool, a reward
on the last reply."""
import random

import verifiers.v1 as vf


class Adder(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "sums"

    @vf.tool
    def add(self, a: int, b: int) -> str:
        """Adds two whole numbers."""
        return str(a + b)


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(self.data.answer in (trace.last_reply or ""))

    @vf.reward(weight=0.1)
    async def digits(self, trace: vf.Trace) -> float:
        """Partial credit: the answer's digits in the reply."""
        return sum(d in (trace.last_reply or "") for d in set(self.data.answer)) / len(set(self.data.answer))


class SumsConfig(vf.TasksetConfig):
    rows: int = 6


class Sums(vf.Taskset[SumTask, SumsConfig]):
    def load(self):
        rng = random.Random(5)
        pairs = [(rng.randint(1, 50), rng.randint(1, 50)) for _ in range(self.config.rows)]
        rows = [SumData(prompt=f"What is {a}+{b}?", system_prompt="Use the tool.", answer=str(a + b)) for a, b in pairs]
        return [SumTask(row, self.config.task) for row in rows]

    @classmethod
    def toolsets(cls, config):
        return [Adder(vf.ToolsetConfig())]


__all__ = ["Sums"]

if __name__ == "__main__":
    Adder.run()
'''


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return create_chat_model(tmp_path_factory.mktemp("chat"), ChatModelSpec(warmup_iterations=4, warmup_batch=4))


SMALL_STEPS = """
[algorithm]
group_size = 4
prompts_per_step = 2
micro_batch_groups = 2
eval_every = 2
"""
"""Steps of 2 prompts, 4 episodes each, evaluated every 2 steps."""


def run_two_steps(job: Path, output: Path, model_dir: Path) -> Path:
    """`rlmesh up --job` for 2 steps; the run's folder once it finished."""
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
            str(model_dir),
            "--base-port",
            str(free_base_port()),
            "--steps",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return output


def metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_python_environment_trains_episodes_through_sessions(tmp_path, chat_model):
    (tmp_path / "echo_env.py").write_text(ENVIRONMENT)
    (tmp_path / "rows.jsonl").write_text(
        "".join(json.dumps({"question": f"What is {i} plus {i}?"}) + "\n" for i in range(24))
    )
    job = tmp_path / "job.toml"
    job.write_text(
        """
[[tasks]]
name = "echo"
sampling.max_tokens = 12
[tasks.dataset]
path = "rows.jsonl"
fields = { prompt = "question" }
[tasks.eval]
holdout = 4
prompts = 4
samples = 1
[tasks.environment]
python = "echo_env.py:Echo"
max_turns = 3
"""
        + SMALL_STEPS
    )
    output = run_two_steps(job, tmp_path / "run", chat_model)
    steps = [r for r in metrics(output) if "loss" in r]
    assert len(steps) == 2
    for record in steps:
        assert record["episodes/count"] == 8 and record["episodes/turns"] == 2
        assert record["episodes/ended/done"] == 8 and record["episodes/ended/environment_error"] == 0
        assert record["episodes/tokens/model"] > 0 and record["episodes/tokens/environment"] > 0
        assert record["episodes/tokens/template"] > 0
    evaluations = [r for r in metrics(output) if "eval/echo/sampled_reward" in r]
    assert [r["step"] for r in evaluations] == [0, 2]
    ledger = [json.loads(line) for line in (output / "rollouts.jsonl").read_text().splitlines()]
    accepted = [r for r in ledger if r["event"] == "accepted"]
    assert len(accepted) == 4 and all(r["episodes"] == ["done"] * 4 for r in accepted)


def test_a_verifiers_environment_runs_unchanged_and_its_episodes_train(tmp_path, chat_model):
    (tmp_path / "sums_env.py").write_text(VERIFIERS_ENVIRONMENT)
    job = tmp_path / "job.toml"
    job.write_text(
        """
[[tasks]]
name = "sums"
kind = "verifiers"
sampling.max_tokens = 16
[tasks.eval]
holdout = 2
prompts = 2
samples = 1
[tasks.environment]
verifiers = "sums_env"
verifiers_args = { rows = 8 }
max_turns = 3
"""
        + SMALL_STEPS
    )
    output = run_two_steps(job, tmp_path / "run", chat_model)
    steps = [r for r in metrics(output) if "loss" in r]
    assert len(steps) == 2
    for record in steps:
        # Every episode ran to its end, its model calls made by verifiers through the gateway (the
        # session's turns: the rows' messages rendered through the chat template, the model's
        # tokens), and was scored by the taskset's rewards.
        assert record["episodes/count"] == 8 and record["episodes/ended/done"] == 8
        assert (
            record["episodes/turns"] >= 1
            and record["episodes/tokens/model"] > 0
            and record["episodes/tokens/template"] > 0
        )
        assert record["loss"] == record["loss"] and 0.0 <= record["reward"] <= 1.1
    ledger = [json.loads(line) for line in (output / "rollouts.jsonl").read_text().splitlines()]
    trained = [r for r in ledger if r["event"] == "trained"]
    assert [r["step"] for r in trained] == [0, 1] and all(len(r["prompts"]) == 2 for r in trained)
    # The prompts are the taskset's own rows, two of the eight held out.
    uids = {uid for r in trained for *_, uid in r["prompts"]}
    assert uids <= {f"task-{i}" for i in range(8)}
    assert [r["step"] for r in metrics(output) if "eval/sums/sampled_reward" in r] == [0, 2]
