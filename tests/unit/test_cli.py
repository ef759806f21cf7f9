"""Command-line bad input: a clear message and a non-zero exit, before anything starts."""

import subprocess
import sys


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "rlmesh.cli", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_up_refuses_bad_arguments():
    result = run("up", "--rollout-instances", "0")
    assert result.returncode == 2 and "argument --rollout-instances: must be at least 1, got 0" in result.stderr
    result = run("up", "--steps", "0")
    assert result.returncode == 2 and "must be at least 1" in result.stderr
    result = run("up", "--max-staleness", "-1")
    assert result.returncode == 2 and "--max-staleness" in result.stderr


def test_a_service_with_a_bad_setting_names_the_field():
    result = run("manager", env={"RLMESH_MANAGER_SERVER__PORT": "not-a-port"})
    assert result.returncode == 2
    assert "server.port" in result.stderr
    result = run("rollout")
    assert result.returncode == 2 and "engine" in result.stderr


def test_health_of_nothing_is_not_serving():
    from rlmesh.launch.ports import free_port

    result = run("health", f"127.0.0.1:{free_port()}", "--timeout", "0.5")
    assert result.returncode == 1 and "NOT SERVING" in result.stdout
