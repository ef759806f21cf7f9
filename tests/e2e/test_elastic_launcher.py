"""`rlmesh up` keeps its mesh running: a rollout instance killed with SIGKILL and the weights
service killed mid-run are restarted while training goes on; `rlmesh scale` adds and drains
instances within MIN:MAX; no prompt is delivered twice; nothing is left behind."""

import collections
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rlmesh.launch.ports import free_base_port
from rlmesh.launch.processes import mesh_processes
from tests.support.paths import REPO_ROOT
from tests.support.run_outputs import last_trained_step
from tests.support.waiting import wait_until

pytestmark = pytest.mark.e2e


def mesh_state(output_dir: Path) -> dict | None:
    try:
        return json.loads((output_dir / "mesh.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def running(output_dir: Path) -> dict[str, int]:
    state = mesh_state(output_dir)
    return {r["name"]: r["pid"] for r in state["rollout_instances"]["running"]} if state else {}


def service_pid(output_dir: Path, service: str) -> int:
    pids = mesh_processes(output_dir, service)
    assert pids, f"no {service} process"
    return pids[0]


def scale(output_dir: Path, count: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlmesh.cli.main", "scale", "--run", str(output_dir), "--rollout-instances", str(count)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )


def test_instances_and_the_weights_service_come_back_and_scale_while_training_goes_on(model_dir, tmp_path):
    output_dir = tmp_path / "run"
    log = (tmp_path / "up.log").open("w")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlmesh.cli.main",
            "up",
            "--steps",
            "100000",
            "--rollout-instances",
            "1:3",
            "--base-port",
            str(free_base_port()),
            "--model-dir",
            str(model_dir),
            "--output-dir",
            str(output_dir),
            "--set",
            "algorithm.eval_every=100000",
            "--set",
            "tasks.0.eval.prompts=8",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO_ROOT,
    )
    try:
        wait_until(lambda: last_trained_step(output_dir) >= 2, 180, "training to start")

        result = scale(output_dir, 2)
        assert result.returncode == 0, result.stderr
        assert "rollout instances: 2 (rollout-0, rollout-1)" in result.stdout
        refused = scale(output_dir, 4)
        assert refused.returncode == 2 and "runs 1 to 3 rollout instances" in refused.stderr

        killed = running(output_dir)["rollout-1"]
        os.kill(killed, signal.SIGKILL)
        wait_until(lambda: running(output_dir).get("rollout-1") not in (None, killed), 60, "rollout-1 to be restarted")
        steps = last_trained_step(output_dir)
        wait_until(
            lambda: last_trained_step(output_dir) >= steps + 3, 120, "training to go on after the instance restarted"
        )

        os.kill(service_pid(output_dir, "weights"), signal.SIGKILL)
        steps = last_trained_step(output_dir)
        wait_until(
            lambda: last_trained_step(output_dir) >= steps + 3,
            120,
            "training to go on after the weights service restarted",
        )

        result = scale(output_dir, 1)
        assert result.returncode == 0, result.stderr
        assert "rollout instances: 1 (rollout-0)" in result.stdout
        steps = last_trained_step(output_dir)
        wait_until(lambda: last_trained_step(output_dir) >= steps + 2, 120, "training to go on with one instance")
    finally:
        process.send_signal(signal.SIGINT)
        code = process.wait(120)
        log.close()
    console = (tmp_path / "up.log").read_text()
    assert code == 130, console[-3000:]
    assert "rollout-1 exited (killed by signal 9); restarting in 1 s" in console
    assert "rollout-1 restarted" in console and "weights exited (killed by signal 9)" in console
    assert "weights restarted" in console and "rollout-1 left (drained)" in console
    assert (
        "rollout instances: 1 -> 2 (rlmesh scale)" in console and "rollout instances: 2 -> 1 (rlmesh scale)" in console
    )
    ledger = [json.loads(line) for line in (output_dir / "rollouts.jsonl").read_text().splitlines()]
    received = collections.Counter((r["batch_id"], r["prompt_id"]) for r in ledger if r["event"] == "accepted")
    submitted = {(r["batch_id"], p) for r in ledger if r["event"] == "submitted" for p in r["prompts"]}
    assert set(received.values()) == {1}, "a prompt was delivered twice"
    assert set(received) <= submitted
    assert mesh_processes(output_dir) == [] and not (output_dir / "mesh.json").exists()


def test_the_autoscaler_adds_an_instance_when_the_manager_recommends_one(model_dir, tmp_path):
    """An instance that decodes 8 sequences at once takes the step's 128 in sixteen waves, well over
    the time training takes (four waves came within 20 % of it, too close to call on a slower
    machine), so the manager recommends more instances than one; with a short patience the launcher
    adds one, and no more than MAX."""
    output_dir = tmp_path / "run"
    log_path = tmp_path / "up.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rlmesh.cli.main",
                "up",
                "--steps",
                "100000",
                "--rollout-instances",
                "1:2",
                "--autoscale",
                "--base-port",
                str(free_base_port()),
                "--model-dir",
                str(model_dir),
                "--output-dir",
                str(output_dir),
                "--set",
                "algorithm.eval_every=100000",
                "--set",
                "tasks.0.eval.prompts=8",
                "--set",
                "rollout.engine.max_batch_size=8",
                "--set",
                "mesh.autoscale_patience_seconds=3",
                "--set",
                "mesh.autoscale_cooldown_seconds=3",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
        )
        try:
            wait_until(lambda: len(running(output_dir)) == 2, 180, "the autoscaler to add an instance")
            steps = last_trained_step(output_dir)
            wait_until(lambda: last_trained_step(output_dir) >= steps + 2, 120, "training to go on with two instances")
        finally:
            process.send_signal(signal.SIGINT)
            code = process.wait(120)
    console = log_path.read_text()
    assert code == 130, console[-3000:]
    assert "rollout instances: 1 -> 2 (autoscale: the manager recommends" in console
    assert "-> 3" not in console
    assert mesh_processes(output_dir) == []
