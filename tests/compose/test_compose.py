"""`docker compose` for real (`make test-compose`): the images build offline from the wheelhouse
and share their dependency layers, the mesh trains and its reward rises, a stranger's
PublishVersion is refused (authorization on by default), a killed rollout
container is restarted and training goes on, three scaled instances get unique ids and all
receive work, and `down -v` leaves nothing behind; then a multi-turn job whose episodes are an agent
command reaching the manager's gateway (examples/agent-command) trains in a fresh mesh. Starts a
Docker engine if none answers."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import compose
import grpc
import pytest

from rlmesh.manager.v1 import manager_pb2, manager_pb2_grpc
from rlmesh.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from tests.support.paths import REPO_ROOT
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.compose, pytest.mark.timeout(5400)]
"""Building the images takes about 2 minutes here on overlay2, 10 on vfs."""

COMPOSE = Path(compose.__file__).parent / "docker-compose"
PROJECT = "rlmesh-compose-test"
LOCAL_BASE = "rlmesh-base:bookworm"
"""The base built from Debian packages (deploy/docker/base-image.sh) when BASE_IMAGE is not set:
no image registry is needed."""
SERVICES = ("manager", "weights", "trainer", "rollout")
BUILD_TIMEOUT = 3600
MANAGER, TRAINER = "127.0.0.1:50151", "127.0.0.1:50153"


def run(
    command: list[str], env: dict[str, str], timeout: float = 600, check: bool = True
) -> subprocess.CompletedProcess:
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return result


@pytest.fixture(scope="module")
def docker_env() -> dict[str, str]:
    """The environment of every docker call: the reachable engine, or one started here (and
    stopped at the end)."""
    env = dict(os.environ)
    if run(["docker", "info"], env, check=False).returncode != 0:
        exports = run([str(REPO_ROOT / "deploy" / "docker" / "engine.sh"), "start"], env, timeout=600).stdout
        env |= dict(
            line.removeprefix("export ").split("=", 1) for line in exports.splitlines() if line.startswith("export ")
        )
    yield env
    if env.get("RLMESH_DOCKER_STARTED"):
        run([str(REPO_ROOT / "deploy" / "docker" / "engine.sh"), "stop"], env, check=False)


@pytest.fixture(scope="module")
def compose_env(docker_env) -> dict[str, str]:
    env = {**docker_env, "COMPOSE_PROFILES": "cpu", "RLMESH_STEPS": "100000"}
    env.setdefault("BASE_IMAGE", LOCAL_BASE)
    if (
        env["BASE_IMAGE"] == LOCAL_BASE
        and run(["docker", "image", "inspect", LOCAL_BASE], env, check=False).returncode != 0
    ):
        run([str(REPO_ROOT / "deploy" / "docker" / "base-image.sh"), LOCAL_BASE], env, timeout=1200)
    return env


@pytest.fixture(scope="module")
def mesh(compose_env) -> Callable[..., subprocess.CompletedProcess]:
    """`docker compose -p PROJECT ...` on the built images; `down -v` whatever happens."""

    def docker_compose(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        return run([str(COMPOSE), "-p", PROJECT, *args], compose_env, timeout=timeout, check=check)

    started = time.monotonic()
    # One service first: it builds the stages every image shares, which the others then take
    # from the cache instead of building them side by side.
    docker_compose("build", "trainer", timeout=BUILD_TIMEOUT)
    docker_compose("build", timeout=BUILD_TIMEOUT)
    print(f"images built in {time.monotonic() - started:.0f} s")
    try:
        yield docker_compose
    finally:
        docker_compose("down", "-v", "--remove-orphans", check=False)


def container_ids(mesh, service: str) -> list[str]:
    return mesh("ps", "-q", service).stdout.split()


def inspect(env: dict[str, str], container: str) -> dict:
    return json.loads(run(["docker", "inspect", container], env).stdout)[0]


OPERATOR_SECRET: list[str] = []
"""The operator's secret of the mesh (secrets-init wrote it into the secrets volume), once read."""


def operator_metadata(mesh) -> tuple[tuple[str, str], ...]:
    if not OPERATOR_SECRET:
        OPERATOR_SECRET.append(mesh("exec", "-T", "manager", "cat", "/secrets/operator.secret").stdout.strip())
    return (("authorization", f"Bearer {OPERATOR_SECRET[0]}"),)


async def _training_status(metadata: tuple) -> trainer_pb2.GetTrainingStatusResponse:
    async with grpc.aio.insecure_channel(TRAINER) as channel:
        return await trainer_pb2_grpc.TrainerServiceStub(channel).GetTrainingStatus(
            trainer_pb2.GetTrainingStatusRequest(), timeout=5.0, metadata=metadata
        )


async def _manager_status(metadata: tuple) -> manager_pb2.GetStatusResponse:
    async with grpc.aio.insecure_channel(MANAGER) as channel:
        return await manager_pb2_grpc.ManagerServiceStub(channel).GetStatus(
            manager_pb2.GetStatusRequest(), timeout=5.0, metadata=metadata
        )


def training_step(mesh) -> int:
    try:
        return asyncio.run(_training_status(operator_metadata(mesh))).step
    except Exception:  # noqa: BLE001 - not up yet, or restarting: no step to report
        return -1


def test_the_four_images_share_their_layers_and_load_the_transfer_engine(mesh, compose_env):
    layers = {service: inspect(compose_env, f"rlmesh-{service}:cpu")["RootFS"]["Layers"] for service in SERVICES}
    # The targets differ only in their settings: every filesystem layer is shared.
    assert len({tuple(v) for v in layers.values()}) == 1, layers
    probe = "import mooncake.engine, torch, rlmesh.manager.v1.manager_pb2; print(torch.__version__)"
    result = run(
        ["docker", "run", "--rm", "--network", "none", "rlmesh-manager:cpu", "python", "-c", probe], compose_env
    )
    assert result.stdout.strip().startswith("2.13.0")


def test_the_mesh_trains_and_its_reward_rises(mesh):
    mesh("up", "-d", timeout=900)
    wait_until(lambda: training_step(mesh) >= 100, 600, "100 training steps", interval=1.0)
    lines = mesh("exec", "-T", "trainer", "cat", "/runs/compose/metrics.jsonl").stdout.splitlines()
    rewards = [record["reward"] for record in map(json.loads, lines) if "reward" in record]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"reward: first 10 steps {first:.3f}, last 10 of {len(rewards)} {last:.3f}")
    assert last > first + 0.1, f"reward did not rise: {first:.3f} -> {last:.3f}"


async def _publish(metadata: tuple) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(MANAGER) as channel:
        try:
            await manager_pb2_grpc.ManagerServiceStub(channel).PublishVersion(
                manager_pb2.PublishVersionRequest(version=999999), timeout=5.0, metadata=metadata
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_a_stranger_cannot_publish_a_version(mesh):
    """The probe of a new user, from the host: refused without a credential and with the
    operator's; the mesh reports authorization on and trains on."""
    assert asyncio.run(_publish(())) == grpc.StatusCode.UNAUTHENTICATED
    assert asyncio.run(_publish(operator_metadata(mesh))) == grpc.StatusCode.PERMISSION_DENIED
    assert asyncio.run(_manager_status(operator_metadata(mesh))).authorization == "bearer secrets"
    step = training_step(mesh)
    wait_until(lambda: training_step(mesh) >= step + 2, 300, "2 more training steps after the probe", interval=1.0)


def test_a_killed_rollout_container_is_restarted_and_training_goes_on(mesh, compose_env):
    [container] = container_ids(mesh, "rollout")
    before = inspect(compose_env, container)
    # SIGKILL from outside, as an OOM kill or a crash: the restart policy, not a manual stop.
    os.kill(before["State"]["Pid"], signal.SIGKILL)
    wait_until(
        lambda: (
            inspect(compose_env, container)["RestartCount"] > before["RestartCount"]
            and inspect(compose_env, container)["State"]["Health"]["Status"] == "healthy"
        ),
        300,
        "the rollout container restarted",
        interval=1.0,
    )
    step = training_step(mesh)
    wait_until(lambda: training_step(mesh) >= step + 10, 300, "10 more training steps after the restart", interval=1.0)
    instances = asyncio.run(_manager_status(operator_metadata(mesh))).instances
    assert [i.instance_id.split("-")[0] for i in instances] == [before["Config"]["Hostname"]]


def test_three_scaled_instances_have_their_own_ids_and_all_get_work(mesh, compose_env):
    mesh("up", "-d", "--no-recreate", "--scale", "rollout=3", timeout=900)
    hostnames = {inspect(compose_env, c)["Config"]["Hostname"] for c in container_ids(mesh, "rollout")}
    assert len(hostnames) == 3

    def every_instance_generated() -> bool:
        instances = asyncio.run(_manager_status(operator_metadata(mesh))).instances
        return (
            len(instances) == 3
            and {i.instance_id.split("-")[0] for i in instances} == hostnames
            and all(i.generated_tokens > 0 for i in instances)
        )

    wait_until(every_instance_generated, 300, "3 instances, named after their hostnames, each generating", interval=1.0)


def test_down_leaves_nothing(mesh, compose_env):
    mesh("down", "-v", "--remove-orphans")
    label = f"label=com.docker.compose.project={PROJECT}"
    for kind in (["ps", "-a"], ["volume", "ls"], ["network", "ls"]):
        left = run(["docker", *kind, "-q", "--filter", label], compose_env).stdout.split()
        assert not left, f"docker {' '.join(kind)}: {left} left after down -v"


def test_a_multi_turn_job_with_an_agent_command_trains_through_the_managers_gateway(mesh):
    """examples/agent-command in containers, in a fresh mesh: every episode's harness (a process
    in the trainer's container) holds its conversation with the policy through the manager's
    gateway on the compose network, reports its reward, and ends `done`."""
    agent = ("-f", "docker-compose.yml", "-f", "examples/agent-command/compose.yml")
    OPERATOR_SECRET.clear()
    mesh(*agent, "up", "-d", timeout=900)
    try:
        wait_until(lambda: training_step(mesh) >= 3, 600, "3 training steps of the agent job", interval=1.0)
        lines = mesh(*agent, "exec", "-T", "trainer", "cat", "/runs/agent-command/metrics.jsonl").stdout.splitlines()
        steps = [record for record in map(json.loads, lines) if "loss" in record]
        assert len(steps) >= 3
        for record in steps:
            assert record["episodes/count"] == 16 and record["episodes/ended/done"] == 16, record
            assert record["episodes/turns"] == 3 and record["episodes/tokens/model"] > 0, record
    finally:
        mesh(*agent, "down", "-v", "--remove-orphans", check=False)
