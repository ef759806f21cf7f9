"""docker-compose.yml rendered offline by the real Compose binary for each profile (cpu, gpu,
gpu-vllm, observe, and with the TLS file), then checked for what the mesh needs: one Dockerfile target per
service, a scalable rollout, GPU reservations, and Prometheus and Grafana wired to the services."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import compose
import pytest
import yaml

from tests.support.paths import REPO_ROOT

COMPOSE = Path(compose.__file__).parent / "docker-compose"
GRPC_PORTS = {"manager": 50151, "weights": 50152, "trainer": 50153, "rollout": 50161}
METRICS_PORT_OFFSET = 1000


def render(profiles: str, *files: str) -> dict:
    env = {**os.environ, "COMPOSE_PROFILES": profiles}
    env.pop("BASE_IMAGE", None)
    command = [
        str(COMPOSE),
        *(arg for f in ("docker-compose.yml", *files) for arg in ("-f", f)),
        "config",
        "--format",
        "json",
    ]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def dockerfile_targets() -> set[str]:
    return set(re.findall(r"^FROM \S+ AS (\S+)$", (REPO_ROOT / "Dockerfile").read_text(), re.MULTILINE))


def test_the_cpu_mesh_builds_every_service_from_one_dockerfile():
    services = render("cpu")["services"]
    assert set(services) == {"secrets-init", "model-init", "manager", "weights", "rollout", "trainer"}
    one_shot_targets = {"model-init": "trainer", "secrets-init": "manager"}
    for name, service in services.items():
        build = service["build"]
        assert build["dockerfile"] == "Dockerfile" and build["target"] == one_shot_targets.get(name, name)
        assert build["args"] == {"BASE_IMAGE": "python:3.11-slim"}
        assert build["target"] in dockerfile_targets()
    assert {services["model-init"]["image"], services["trainer"]["image"]} == {"rlmesh-trainer:cpu"}
    for name, port in GRPC_PORTS.items():
        assert services[name]["healthcheck"]["test"] == ["CMD", "rlmesh", "health", f"127.0.0.1:{port}"], name


ROLE_OF_SERVICE = {
    "manager": "manager",
    "weights": "weights",
    "rollout": "instance",
    "trainer": "trainer",
    "rollout-gpu": "instance",
    "rollout-gpu-vllm": "instance",
    "trainer-gpu": "trainer",
}


@pytest.mark.parametrize("profile", ["cpu", "gpu", "gpu-vllm"])
def test_every_service_is_authorized_by_role_unless_told_insecure(profile, monkeypatch):
    """Each service reads the verifiers and its own role's secret from the volume secrets-init
    fills, which it waits for (through the manager); RLMESH_INSECURE=true turns it off."""
    services = render(profile)["services"]
    assert services["secrets-init"]["command"] == ["rlmesh", "secrets", "--dir", "/secrets"]
    assert services["manager"]["depends_on"]["secrets-init"]["condition"] == "service_completed_successfully"
    assert services["manager"]["environment"]["RLMESH_MANAGER_WEIGHTS_ADDRESS"] == "weights:50152"
    for name, service in services.items():
        if name not in ROLE_OF_SERVICE:
            continue
        prefix = f"RLMESH_{name.split('-')[0].upper()}_SERVER__AUTH__"
        environment = service["environment"]
        assert environment[f"{prefix}VERIFIERS_FILE"] == "/secrets/verifiers.json", name
        assert environment[f"{prefix}SECRET_FILE"] == f"/secrets/{ROLE_OF_SERVICE[name]}.secret", name
        assert environment[f"{prefix}INSECURE"] == "false", name
        assert any(
            v["type"] == "volume" and v["source"] == "secrets" and v["target"] == "/secrets" and v.get("read_only")
            for v in service["volumes"]
        ), name
    monkeypatch.setenv("RLMESH_INSECURE", "true")
    assert render(profile)["services"]["manager"]["environment"]["RLMESH_MANAGER_SERVER__AUTH__INSECURE"] == "true"


def test_rollout_scales_and_restarts():
    rollout = render("cpu")["services"]["rollout"]
    # A fixed host port, instance id or advertised host would make replicas collide.
    assert "ports" not in rollout and "container_name" not in rollout
    assert not {"RLMESH_ROLLOUT_INSTANCE_ID", "RLMESH_ROLLOUT_SERVER__ADVERTISE_HOST"} & set(rollout["environment"])
    assert rollout["restart"] == "on-failure"


@pytest.mark.parametrize(
    ("profile", "rollout_name", "target"),
    [("gpu", "rollout-gpu", "rollout"), ("gpu-vllm", "rollout-gpu-vllm", "rollout-vllm")],
)
def test_the_gpu_profiles_reserve_gpus_for_the_rollout_engine_and_the_nccl_trainer(profile, rollout_name, target):
    services = render(profile)["services"]
    assert set(services) == {"secrets-init", "manager", "weights", rollout_name, "trainer-gpu"}
    rollout, trainer = services[rollout_name], services["trainer-gpu"]
    assert rollout["build"]["target"] == target and target in dockerfile_targets()
    if profile == "gpu":
        # The torch engine's CUDA path, not vLLM.
        assert rollout["environment"]["RLMESH_ROLLOUT_ENGINE__DEVICE"] == "cuda"
    assert trainer["environment"]["RLMESH_TRAINER_DISTRIBUTED_BACKEND"] == "nccl"
    for service in (rollout, trainer):
        [device] = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert rollout_name in trainer["depends_on"]
    assert (
        rollout["healthcheck"]["test"][-1] == "127.0.0.1:50161"
        and trainer["healthcheck"]["test"][-1] == "127.0.0.1:50153"
    )


def test_observe_scrapes_every_service_and_provisions_the_dashboard():
    services = render("cpu,observe")["services"]
    assert {"prometheus", "grafana"} <= set(services)
    config = yaml.safe_load((REPO_ROOT / "deploy" / "observe" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == set(GRPC_PORTS)
    for name, port in GRPC_PORTS.items():
        metrics = port + METRICS_PORT_OFFSET
        job = jobs[name]
        if name == "rollout":
            # Every replica of a scaled service, through the compose network's DNS.
            [discovery] = job["dns_sd_configs"]
            assert "rollout" in discovery["names"] and discovery["port"] == metrics
        else:
            assert f"{name}:{metrics}" in job["static_configs"][0]["targets"]
    mounts = {v["target"]: REPO_ROOT / v["source"] for v in services["grafana"]["volumes"] if v["type"] == "bind"}
    datasource = yaml.safe_load((mounts["/etc/grafana/provisioning"] / "datasources" / "prometheus.yml").read_text())
    dashboard = json.loads((mounts["/var/lib/grafana/dashboards"] / "rlmesh.json").read_text())
    uids = {panel["datasource"]["uid"] for panel in dashboard["panels"]}
    assert uids == {datasource["datasources"][0]["uid"]}
    assert all(target["expr"] for panel in dashboard["panels"] for target in panel["targets"])


@pytest.mark.parametrize("profiles", ["cpu", "gpu"])
def test_the_tls_file_applies_to_every_profile(profiles, tmp_path):
    services = render(profiles, "docker-compose.tls.yml")["services"]
    for name in ("manager", "weights"):
        assert services[name]["environment"][f"RLMESH_{name.upper()}_SERVER__TLS__CA_FILE"] == "/certs/ca.pem"


@pytest.mark.parametrize("profile", ["cpu", "gpu", "gpu-vllm"])
def test_the_trainer_points_agents_at_the_managers_gateway(profile):
    """Agent commands and verifiers environments reach their sessions on the manager's OpenAI
    gateway: the manager serves it on a published port with the policy's tokenizer mounted, and
    every trainer is given its address on the compose network."""
    services = render(profile)["services"]
    manager = services["manager"]
    port = manager["environment"]["RLMESH_MANAGER_GATEWAY_PORT"]
    assert any(str(p["target"]) == port and str(p["published"]) == port for p in manager["ports"])
    model_dir = manager["environment"]["RLMESH_MANAGER_MODEL_DIR"]
    assert any(
        v["source"] == "models" and model_dir.startswith(v["target"] + "/") and v.get("read_only")
        for v in manager["volumes"]
    )
    trainers = [s for name, s in services.items() if name.startswith("trainer")]
    assert trainers
    for trainer in trainers:
        assert trainer["environment"]["RLMESH_TRAINER_GATEWAY_ADDRESS"] == f"manager:{port}"
        assert trainer["environment"]["RLMESH_TRAINER_MODEL_DIR"] == model_dir
