"""Jobs run by `rlmesh up --job` as real processes: the user's own example task trains (its
held-out reward rises) with a secret per role made for the run, a two-task mixture reports each
task's reward with one task scored by the Node verifier over gRPC (which takes a token of its own,
named by the task, and refuses the trainer's secret), and a reward that always fails stops the job
saying why (a run with --insecure)."""

import json
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from rlmesh.launch.ports import free_base_port, free_port
from rlmesh.reward.v1 import reward_pb2, reward_pb2_grpc
from rlmesh.rpc.credentials import create_secrets, read_secret, secret_path
from tests.support.paths import REPO_ROOT

# Jobs without a model folder: the first run creates the built-in model under .rlmesh/, and a run
# that starts meanwhile (the GPU check's short job) waits for it.
pytestmark = pytest.mark.e2e

EXAMPLE = REPO_ROOT / "examples" / "nines-complement"
NODE_VERIFIER = REPO_ROOT / "examples" / "node-verifier"


def up(job: Path, output_dir: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "rlmesh.cli.main",
        "up",
        "--job",
        str(job),
        "--output-dir",
        str(output_dir),
        "--base-port",
        str(free_base_port()),
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)


def metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_example_task_from_its_own_files_trains(tmp_path):
    # Validations at normal priority: at low priority, on the one instance that training keeps
    # busy, their requests wait for a gap in training work, which the suite's load may not leave.
    result = up(
        EXAMPLE / "job.toml",
        tmp_path / "run",
        "--steps",
        "40",
        "--set",
        "algorithm.eval_every=20",
        "--set",
        "algorithm.validation_priority=normal",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    secrets = tmp_path / "run" / "secrets"
    assert f"every call authorized by role, secrets in {secrets}" in result.stdout
    assert {stat.S_IMODE(path.stat().st_mode) for path in secrets.glob("*.secret")} == {0o600}
    assert len(list(secrets.glob("*.secret"))) == 6 and "INSECURE" not in result.stdout + result.stderr
    # Background validations are filed when they finish; one whose version a newer push superseded
    # is replaced by the next version's.
    evaluations = sorted((r for r in metrics(tmp_path / "run") if "eval/sampled_reward" in r), key=lambda r: r["step"])
    assert evaluations[0]["step"] == 0 and 20 <= evaluations[1]["step"] < 40 and evaluations[-1]["step"] == 40
    start, end = evaluations[0]["eval/complement/sampled_reward"], evaluations[-1]["eval/complement/sampled_reward"]
    assert end > start + 0.03, f"held-out reward {start:.3f} -> {end:.3f}"
    steps = [r for r in metrics(tmp_path / "run") if "reward" in r]
    assert {"task/complement/reward", "task/complement/exact", "task/complement/length_ok"} <= set(steps[-1])
    assert sum(r["reward_failures"] for r in steps) == 0


@pytest.fixture
def node_verifier(tmp_path):
    """The Node verifier, checking callers against a token of its own (the task's remote_credential
    names its file); the run's secrets are made beforehand, to show the verifier gets none of them."""
    node = shutil.which("node")
    assert node, "node is needed for the example verifier"
    secrets = create_secrets(tmp_path / "secrets")
    (tmp_path / "verifier.token").write_text("the-verifiers-own-token\n")
    port = free_port()
    process = subprocess.Popen(
        [
            node,
            "server.js",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--token-file",
            str(tmp_path / "verifier.token"),
        ],
        cwd=NODE_VERIFIER,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert process.stdout.readline().strip() == f"listening on {port}"
        yield f"127.0.0.1:{port}", secrets
    finally:
        process.terminate()
        process.wait(10)


def score_as(address: str, secret: str | None) -> grpc.StatusCode:
    metadata = (("authorization", f"Bearer {secret}"),) if secret else ()
    with grpc.insecure_channel(address) as channel:
        try:
            reward_pb2_grpc.RewardServiceStub(channel).Score(
                reward_pb2.ScoreRequest(task="complement"), timeout=10, metadata=metadata
            )
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_a_mixture_reports_each_task_and_the_node_verifier_scores_one(tmp_path, node_verifier):
    node_verifier, secrets = node_verifier
    assert score_as(node_verifier, None) == grpc.StatusCode.UNAUTHENTICATED
    assert score_as(node_verifier, read_secret(secret_path(secrets, "trainer"))) == grpc.StatusCode.UNAUTHENTICATED
    assert score_as(node_verifier, "the-verifiers-own-token") == grpc.StatusCode.OK
    job = tmp_path / "job.toml"
    job.write_text(f"""
[[tasks]]
name = "increment"
kind = "increment"
weight = 1.0
eval.prompts = 16

[[tasks]]
name = "complement"
kind = "dataset"
weight = 1.0
prompt.template = "{{number}}="
reward.remote = "{node_verifier}"
reward.remote_credential = "file:verifier.token"
dataset.path = "{EXAMPLE / "train.jsonl"}"
dataset.fields = {{ answer = "complement" }}
eval.path = "{EXAMPLE / "held_out.jsonl"}"
eval.prompts = 16

[algorithm]
steps = 4
eval_every = 2
""")
    result = up(job, tmp_path / "run", "--secrets-dir", str(secrets))
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in metrics(tmp_path / "run") if "reward" in r]
    assert len(steps) == 4
    for record in steps:
        assert {"task/increment/reward", "task/complement/reward"} <= set(record)
        # The verifier's own components: proof it scored every complement sample.
        assert {"task/complement/char_match", "task/complement/exact"} <= set(record)
        assert record["task/complement/reward_failures"] == 0 and record["reward_failures"] == 0
    evaluations = [r for r in metrics(tmp_path / "run") if "eval/sampled_reward" in r]
    assert all({"eval/increment/sampled_reward", "eval/complement/sampled_reward"} <= set(r) for r in evaluations)
    ledger = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert {r["task"] for r in ledger if r["event"] == "accepted"} == {"increment", "complement"}


def test_a_reward_that_always_fails_stops_the_job_saying_why(tmp_path):
    (tmp_path / "broken.py").write_text("def score(completion, answer):\n    raise KeyError('no verifier today')\n")
    job = tmp_path / "job.toml"
    job.write_text("""
[[tasks]]
name = "increment"
kind = "increment"
reward.function = "broken:score"
reward.max_error_rate = 0.2

[algorithm]
steps = 50
""")
    result = up(job, tmp_path / "run", "--insecure", timeout=300)
    assert result.returncode == 1
    assert "rlmesh up: INSECURE: authorization is off, anyone who reaches a port may call every RPC" in result.stderr
    assert not (tmp_path / "run" / "secrets").exists()
    assert "RewardErrorRateExceeded" in result.stderr and "task 'increment'" in result.stderr
    assert "no verifier today" in result.stderr and "reward.max_error_rate = 20%" in result.stderr
