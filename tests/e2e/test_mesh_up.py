"""`rlmesh up` as real processes: it trains (also on two FSDP ranks), accounts for every prompt
exactly once, writes its outputs, serves reflection and Prometheus metrics on every service, shows
in `rlmesh status`, and leaves no process behind (also after Ctrl-C)."""

import asyncio
import collections
import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rlmesh.forking.forkserver import FORK_SERVER_NAME
from rlmesh.launch.ports import free_base_port, free_port
from rlmesh.launch.processes import mesh_processes, process_name
from rlmesh.rpc.channels import call_options, open_channel
from rlmesh.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from rlmesh.transfer.shards import SHM_DIR
from services.trainer.ranks.handoff import SLOT_PREFIX, mesh_tag
from tests.support.clients import grpcurl_output, grpcurl_result
from tests.support.jobs import up_command
from tests.support.paths import REPO_ROOT
from tests.support.processes import parent_pid

pytestmark = pytest.mark.e2e


async def training_step(address: str) -> int:
    async with open_channel(address) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        try:
            status = await stub.GetTrainingStatus(trainer_pb2.GetTrainingStatusRequest(), **call_options(2.0))
        except grpc.aio.AioRpcError:
            return -1
    return status.step


@dataclass
class LiveMesh:
    process: subprocess.Popen
    output_dir: Path
    base_port: int


@pytest.fixture(scope="module")
def live_mesh(model_dir, tmp_path_factory):
    """`rlmesh up` training (a long job) until the module's last test stops it with Ctrl-C."""
    output_dir = tmp_path_factory.mktemp("live") / "run"
    base = free_base_port()
    # Held-out validation only at the start: this mesh trains for the whole module, and a validation
    # every 2 steps would take CPU from the other workers' tests all that time.
    process = subprocess.Popen(
        up_command(model_dir, output_dir, base, steps=10_000) + ["--set", "algorithm.eval_every=100000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while asyncio.run(training_step(f"127.0.0.1:{base + 2}")) < 2:
            assert process.poll() is None, process.stdout.read()
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.5)
        yield LiveMesh(process, output_dir, base)
    finally:
        if process.poll() is None:
            process.kill()


def test_grpcurl_sees_every_service(live_mesh, warm_fork_server):
    base = live_mesh.base_port
    services = {
        base: "ManagerService",
        base + 1: "WeightsService",
        base + 2: "TrainerService",
        base + 10: "RolloutService",
    }
    for port, service in services.items():
        listed = asyncio.run(grpcurl_output(f"127.0.0.1:{port}", "list"))
        assert service in listed and "grpc.health.v1.Health" in listed and "ServerReflection" in listed
    # Each service in its own process, forked by the run's fork server, which is one more: forked in
    # turn by the suite's warm fork server, and found by the run's marker all the same; and the
    # manager's gateway, a helper forked for it under a keeper that ends it with the manager.
    names = sorted(process_name(pid) for pid in mesh_processes(live_mesh.output_dir))
    assert names == sorted(
        [
            FORK_SERVER_NAME,
            "rlmesh-manager",
            "rlmesh-keeper",
            "rlmesh-gateway",
            "rlmesh-weights",
            "rlmesh-rollout",
            "rlmesh-trainer",
        ]
    )
    fork_server = next(pid for pid in mesh_processes(live_mesh.output_dir) if process_name(pid) == FORK_SERVER_NAME)
    assert parent_pid(fork_server) == warm_fork_server.pid
    # The gateway's keeper, like every helper's, is forked by the warm fork server the manager asks.
    gateway = next(pid for pid in mesh_processes(live_mesh.output_dir) if process_name(pid) == "rlmesh-gateway")
    keeper = parent_pid(gateway)
    assert process_name(keeper) == "rlmesh-keeper" and parent_pid(keeper) == warm_fork_server.pid
    assert all(
        parent_pid(pid) == fork_server
        for pid in mesh_processes(live_mesh.output_dir)
        if pid not in (fork_server, keeper, gateway)
    )


def test_a_stranger_cannot_publish_a_version(live_mesh):
    """The probe of a new user: PublishVersion of a far-future version from a shell. Without a
    credential, and with any role but the trainer's, it is refused; even the trainer's secret
    cannot publish a version the weights service does not hold; training goes on."""
    manager = f"127.0.0.1:{live_mesh.base_port}"
    before = asyncio.run(training_step(f"127.0.0.1:{live_mesh.base_port + 2}"))
    publish = ("-d", '{"version": 999999}', manager, "rlmesh.manager.v1.ManagerService/PublishVersion")
    code, _, err = asyncio.run(grpcurl_result(*publish, role=None))
    assert code != 0 and "Code: Unauthenticated" in err and "PublishVersion needs a credential" in err, err
    code, _, err = asyncio.run(grpcurl_result(*publish, role="operator"))
    assert code != 0 and "Code: PermissionDenied" in err and "not open to the operator role" in err, err
    code, _, err = asyncio.run(grpcurl_result(*publish, role="trainer"))
    assert (
        code != 0 and "Code: FailedPrecondition" in err and "version 999999 is not held by the weights service" in err
    ), err
    deadline = time.monotonic() + 120
    while asyncio.run(training_step(f"127.0.0.1:{live_mesh.base_port + 2}")) < before + 2:
        assert live_mesh.process.poll() is None, "training stopped"
        assert time.monotonic() < deadline, "training did not go on"
        time.sleep(0.5)


WATCHED = {
    "manager": {
        "rlmesh_manager_queued_samples",
        "rlmesh_manager_running_samples",
        "rlmesh_manager_token_staleness_max",
        "rlmesh_manager_token_staleness_mean",
        "rlmesh_manager_migrated_samples_total",
        "rlmesh_manager_continued_tokens_total",
        "rlmesh_manager_generated_tokens_total",
        "rlmesh_manager_instance_tokens_per_second",
        "rlmesh_manager_published_version",
    },
    "weights": {
        "rlmesh_weights_latest_version",
        "rlmesh_weights_push_seconds",
        "rlmesh_weights_push_gbps",
        "rlmesh_weights_stored_to_served_seconds",
        "rlmesh_weights_committed_version",
    },
    "rollout-0": {
        "rlmesh_rollout_generated_tokens_total",
        "rlmesh_rollout_tokens_per_second",
        "rlmesh_rollout_running_requests",
        "rlmesh_rollout_weight_version",
    },
    "trainer": {
        "rlmesh_trainer_step",
        "rlmesh_trainer_step_seconds",
        "rlmesh_trainer_reward",
        "rlmesh_trainer_kl",
        "rlmesh_trainer_rollout_wait_seconds",
        "rlmesh_trainer_weight_version",
    },
}
"""The metrics a person watches, by the service (its mesh.json name) that serves them."""
MOVING = {
    "manager": "rlmesh_manager_generated_tokens_total",
    "weights": "rlmesh_weights_latest_version",
    "rollout-0": "rlmesh_rollout_weight_version",
    "trainer": "rlmesh_trainer_step",
}
"""One value per service that must grow while the mesh trains."""


def scrape(address: str) -> dict[str, float]:
    """Every sample of the service's /metrics, by name (the first of each labelled family). The
    timeout is generous: a service busy on an oversubscribed host answers from its thread late."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, sample.value)
    return samples


def metrics_addresses(output_dir: Path) -> dict[str, str]:
    state = json.loads((output_dir / "mesh.json").read_text())
    services = [*state["services"], *state["rollout_instances"]["running"], {"name": "trainer", **state["trainer"]}]
    return {s["name"]: s["metrics"] for s in services}


def test_prometheus_scrapes_every_service_and_the_values_move(live_mesh):
    addresses = metrics_addresses(live_mesh.output_dir)
    assert set(addresses) == set(WATCHED)
    first = {name: scrape(address) for name, address in addresses.items()}
    for name, expected in WATCHED.items():
        assert expected <= set(first[name]), f"{name} does not serve {sorted(expected - set(first[name]))}"
    deadline = time.monotonic() + 60
    while True:
        time.sleep(1.0)
        later = {name: scrape(address) for name, address in addresses.items()}
        still = [name for name, metric in MOVING.items() if later[name][metric] <= first[name][metric]]
        if not still:
            break
        assert time.monotonic() < deadline, f"{still} did not move in 60 s: {[(n, first[n][MOVING[n]]) for n in still]}"
    assert later["rollout-0"]["rlmesh_rollout_tokens_per_second"] >= 0
    assert later["weights"]["rlmesh_weights_push_seconds"] > 0
    # Every series the compose profile `observe`'s Grafana dashboard plots is served.
    dashboard = json.loads((REPO_ROOT / "deploy" / "observe" / "grafana" / "dashboards" / "rlmesh.json").read_text())
    plotted = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"rlmesh_\w+", target["expr"])
    }
    served = {name for samples in later.values() for name in samples}
    assert plotted <= served, f"the dashboard plots series no service serves: {sorted(plotted - served)}"


def test_status_once_prints_the_mesh(live_mesh):
    result = subprocess.run(
        [sys.executable, "-m", "rlmesh.cli.main", "status", "--once", "--run", str(live_mesh.output_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert re.search(r"trainer step \d+/10000", out), out
    assert re.search(r"manager published \d+", out) and "queued" in out and "staleness" in out, out
    assert re.search(r"rollout-0\s+│\s+\d+", out), out
    assert "unreachable" not in out, out


def test_status_names_what_it_cannot_reach(tmp_path):
    missing = subprocess.run(
        [sys.executable, "-m", "rlmesh.cli.main", "status", "--once", "--run", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "no running mesh found" in missing.stderr
    port = free_port()
    down = subprocess.run(
        [sys.executable, "-m", "rlmesh.cli.main", "status", "--once", "--manager", f"127.0.0.1:{port}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert down.returncode == 1 and f"manager 127.0.0.1:{port}: UNAVAILABLE" in down.stderr


def test_ctrl_c_leaves_nothing(live_mesh):
    live_mesh.process.send_signal(signal.SIGINT)
    assert live_mesh.process.wait(timeout=60) == 130
    assert mesh_processes(live_mesh.output_dir) == []


def test_up_trains_on_two_fsdp_ranks_and_every_prompt_comes_back_exactly_once(model_dir, tmp_path):
    """`--trainer-ranks 2`: the trainer runs under torchrun; both ranks hand their shards to the
    weights service through shared memory, checkpoint their own shards, and leave nothing behind.
    Every prompt drawn is generated and trained exactly once, and the run writes all its outputs.
    No warm fork server answers at the socket it is given: it starts its own."""
    output_dir = tmp_path / "run"
    command = up_command(model_dir, output_dir, free_base_port(), steps=4) + [
        "--trainer-ranks",
        "2",
        "--fork-server",
        str(tmp_path / "nobody.sock"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 FSDP ranks" in result.stdout and "held-out sampled reward" in result.stdout
    assert f"no warm fork server answers at {tmp_path / 'nobody.sock'}" in result.stderr
    assert "starting its own fork server" in result.stderr

    ledger = [json.loads(line) for line in (output_dir / "rollouts.jsonl").read_text().splitlines()]
    submitted = collections.Counter(
        (r["batch_id"], p) for r in ledger if r["event"] == "submitted" for p in r["prompts"]
    )
    received = collections.Counter((r["batch_id"], r["prompt_id"]) for r in ledger if r["event"] == "accepted")
    assert len(submitted) == 4 * 16 and set(submitted.values()) == {1}
    assert received == submitted, "a prompt was lost or delivered twice"
    assert all(r["samples"] == 8 for r in ledger if r["event"] == "accepted")
    assert max(r["max_version"] for r in ledger if r["event"] == "accepted") >= 1

    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and [r["weight_version"] for r in steps] == [1, 2, 3, 4]
    for key in (
        "reward",
        "exact_match",
        "loss",
        "kl",
        "staleness_mean",
        "step_seconds",
        "generated_tokens_per_second",
        "rollout_wait_seconds",
        "balance/recommended_rollout_instances",
        "balance/offload_fraction",
        "balance/local_window_seconds",
    ):
        assert all(key in r for r in steps), key
    assert all(
        r["balance/recommended_rollout_instances"] >= 1 and 0 <= r["balance/offload_fraction"] <= 1 for r in steps
    )
    # Held-out validations ran in the background on the rollout instance, each on the version it
    # names; a version a newer push superseded is replaced by a later one, the last never.
    validations = [r for r in records if "eval/sampled_reward" in r]
    assert validations[0]["step"] == 0 and max(r["step"] for r in validations) == 4
    assert all(r["eval/weight_version"] == r["step"] for r in validations)
    assert list((output_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (output_dir / "reward.png").stat().st_size > 0

    model_bytes = 396_160 * 4
    # Each rank handed over about half of the model, never the whole of it. A version's figures are
    # filed under its step once it is served: its upload overlaps the next step.
    publishes = [r for r in records if "publish_rank_bytes" in r]
    assert [r["step"] for r in publishes] == [1, 2, 3, 4]
    assert all(model_bytes / 2 <= r["publish_rank_bytes"] < model_bytes / 2 + 64 * 30 for r in publishes)
    logs = [
        json.loads(line)
        for line in (output_dir / "logs" / "trainer.log").read_text().splitlines()
        if line.startswith("{")
    ]
    assert {(r["rank"], r["world_size"]) for r in logs if r.get("event") == "rank started"} == {(0, 2), (1, 2)}
    assert any(r.get("event") == "stopped by rank 0" and r["rank"] == 1 for r in logs)

    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["weight_version"] == 4
    checkpoint = Path(summary["checkpoint"])
    assert {"shards_rank0.pt", "shards_rank1.pt", "model.safetensors"} <= {p.name for p in checkpoint.iterdir()}
    assert mesh_processes(output_dir) == []
    assert not list(SHM_DIR.glob(f"{SLOT_PREFIX}-{mesh_tag(str(output_dir.resolve()))}-*")), (
        "a rank left its shared memory behind"
    )
