"""Multi-turn jobs run by `rlmesh up --job` as real processes: a Python environment in the user's own
file drives episodes through the manager's sessions, the trainer trains them, and the figures of
episodes (turns, tokens by source, how they ended) and of held-out episodes are filed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlmesh.launch.ports import free_base_port
from rlmesh.models.chat_tiny import ChatModelSpec, create_chat_model

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]

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


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return create_chat_model(tmp_path_factory.mktemp("chat"), ChatModelSpec(warmup_iterations=4, warmup_batch=4))


def metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_python_environment_trains_episodes_through_sessions(tmp_path, chat_model):
    (tmp_path / "echo_env.py").write_text(ENVIRONMENT)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"question": f"What is {i} plus {i}?"}) + "\n" for i in range(24)))
    job = tmp_path / "job.toml"
    job.write_text('''
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

[algorithm]
group_size = 4
prompts_per_step = 2
micro_batch_groups = 2
eval_every = 2
''')
    output = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "rlmesh.cli", "up", "--job", str(job), "--output-dir", str(output),
                             "--model-dir", str(chat_model), "--base-port", str(free_base_port()), "--steps", "2"],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
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
