"""Every setting of every service reaches it from a job: each leaf field of the services' config
models, set to a value other than its default in a job (`rlmesh up --set`), arrives in the config
the service is started with. Fields the launcher wires are listed with the job field that sets them."""

import json
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import pytest
from pydantic import BaseModel, TypeAdapter, ValidationError

from rlmesh.config import load_config
from rlmesh.job import Job, load_job
from rlmesh.settings.handover import service_settings, trainer_settings
from rlmesh.settings.trainer import REFERENCE_COLOCATED
from services.manager.config import ManagerConfig
from services.manager.relay.config import RelayConfig
from services.rollout.config import RolloutConfig
from services.trainer.config import TrainerConfig
from services.weights.config import WeightsConfig

SERVICES: dict[str, type[BaseModel]] = {
    "trainer": TrainerConfig,
    "manager": ManagerConfig,
    "relay": RelayConfig,
    "weights": WeightsConfig,
    "rollout": RolloutConfig,
}
JOB_SECTIONS = {
    "trainer": ("algorithm", "trainer"),
    "manager": ("manager", "algorithm"),
    "relay": ("relay",),
    "weights": ("weights",),
    "rollout": ("rollout",),
}
"""Where a service's own settings sit in a job, under the same field path."""
WIRED = {
    "trainer": {
        "server.host": "mesh.host",
        "server.port": "mesh.base_port",
        "server.advertise_host": "mesh.host",
        "server.tls": "mesh.tls",
        "server.metrics_port": "mesh.base_port",
        "manager_address": "mesh.base_port",
        "weights_address": "mesh.base_port",
        "gateway_address": "mesh.base_port",
        "model_dir": "model.path",
        "output_dir": "output.dir",
        "tasks": "tasks",
        "tracking": "tracking",
        "python_path": "tasks",
        "weights_dtype": "model.dtype",
        "server.auth.insecure": "mesh.insecure",
        "server.auth.verifiers_file": "mesh.secrets_dir",
        "server.auth.secret_file": "mesh.secrets_dir",
    },
    "manager": {
        "server.host": "mesh.host",
        "server.port": "mesh.base_port",
        "server.advertise_host": "mesh.host",
        "server.tls": "mesh.tls",
        "server.metrics_port": "mesh.base_port",
        "journal_path": "output.dir",
        "weights_address": "mesh.base_port",
        "gateway_port": "mesh.base_port",
        "relay_addresses": "mesh.relay_shards",
        "model_dir": "model.path",
        "server.auth.insecure": "mesh.insecure",
        "server.auth.verifiers_file": "mesh.secrets_dir",
        "server.auth.secret_file": "mesh.secrets_dir",
    },
    "relay": {
        "server.host": "mesh.host",
        "server.port": "mesh.relay_shards",
        "server.advertise_host": "mesh.host",
        "server.tls": "mesh.tls",
        "server.metrics_port": "mesh.base_port",
        "journal_path": "output.dir",
        "server.auth.insecure": "mesh.insecure",
        "server.auth.verifiers_file": "mesh.secrets_dir",
        "server.auth.secret_file": "mesh.secrets_dir",
    },
    "weights": {
        "server.host": "mesh.host",
        "server.port": "mesh.base_port",
        "server.advertise_host": "mesh.host",
        "server.tls": "mesh.tls",
        "server.metrics_port": "mesh.base_port",
        "manager_address": "mesh.base_port",
        "server.auth.insecure": "mesh.insecure",
        "server.auth.verifiers_file": "mesh.secrets_dir",
        "server.auth.secret_file": "mesh.secrets_dir",
    },
    "rollout": {
        "server.host": "mesh.host",
        "server.port": "mesh.base_port",
        "server.advertise_host": "mesh.host",
        "server.tls": "mesh.tls",
        "server.metrics_port": "mesh.base_port",
        "instance_id": "mesh.rollout_instances",
        "manager_address": "mesh.base_port",
        "server.auth.insecure": "mesh.insecure",
        "server.auth.verifiers_file": "mesh.secrets_dir",
        "server.auth.secret_file": "mesh.secrets_dir",
        "engine.model_dir": "model.path",
        "engine.dtype": "model.dtype",
        "transfer.mooncake": "weights.backend",
    },
}
"""Service fields the launcher fills in, by the job field that decides them: the mesh's addresses,
ports, instances and security, the model's folder and dtype (one for the trainer and the engines,
so that they agree), the run's folders, and whether a rollout instance offers the weights
service's Mooncake data plane."""
VALUES: dict[str, Any] = {
    "prompts_per_step": 32,
    "micro_batch_groups": 2,
    "placement": REFERENCE_COLOCATED,
    "link_compression": {"rollout-0": "zstd"},
}
"""A non-default value for fields whose other values depend on their neighbours."""


def leaf_fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted path, FieldInfo) of every leaf field of `model`, into its nested models."""
    leaves = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            leaves += leaf_fields(field.annotation, f"{path}.")
        else:
            leaves.append((path, field))
    return leaves


def other_value(path: str, field) -> Any:
    """A valid value of the field other than its default."""
    name = path.rsplit(".", 1)[-1]
    if name in VALUES:
        return VALUES[name]
    default = field.get_default(call_default_factory=True)
    annotation = field.annotation
    choices = [arg for arg in get_args(annotation) if arg is not type(None)]
    if get_origin(annotation) is Literal:
        candidates = list(get_args(annotation))
    elif annotation is bool:
        candidates = [not default]
    elif default is None and choices:
        candidates = [0.1, 2, "x"]
    elif isinstance(default, (int, float)):
        candidates = [default + 1, default * 2, default / 2, 0.5]
    else:
        candidates = []
    adapter = TypeAdapter(Annotated[annotation, *field.metadata] if field.metadata else annotation)
    for candidate in candidates:
        if candidate == default:
            continue
        try:
            adapter.validate_python(candidate)
            return candidate
        except ValidationError:
            continue
    raise AssertionError(f"{path}: no other value to try; add one to VALUES")


def started_config(service: str, job: Job, tmp_path: Path) -> BaseModel:
    """The config the service is started with: what the job hands it, then the launcher's wiring."""
    if service == "trainer":
        return TrainerConfig(**trainer_settings(job, tmp_path, tmp_path, tmp_path))
    path = tmp_path / f"{service}.json"
    path.write_text(json.dumps(service_settings(job)[service]))
    wiring = {"RLMESH_ROLLOUT_ENGINE__MODEL_DIR": str(tmp_path)} if service == "rollout" else {}
    return load_config(SERVICES[service], path, env_prefix=f"RLMESH_{service.upper()}_", environ=wiring)


def value_at(config: BaseModel, path: str) -> Any:
    value: Any = config
    for key in path.split("."):
        value = getattr(value, key)
    return value


def job_field_exists(dotted: str) -> bool:
    model: Any = Job
    for key in dotted.split("."):
        if key not in model.model_fields:
            return False
        model = model.model_fields[key].annotation
    return True


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_every_setting_of_a_service_is_set_from_a_job(service, tmp_path):
    reached, wired = [], []
    for path, field in leaf_fields(SERVICES[service]):
        if any(path == w or path.startswith(f"{w}.") for w in WIRED[service]):
            source = next(WIRED[service][w] for w in WIRED[service] if path == w or path.startswith(f"{w}."))
            assert job_field_exists(source), f"{service} {path}: wired from {source}, which is no job field"
            held = [section for section in JOB_SECTIONS[service] if job_field_exists(f"{section}.{path}")]
            assert not held, f"{service} {path}: wired from {source} and declared again as {held[0]}.{path}"
            wired.append(path)
            continue
        sections = [section for section in JOB_SECTIONS[service] if job_field_exists(f"{section}.{path}")]
        assert sections, (
            f"{service}.{path} cannot be set from a job: no job section holds it and the launcher does not wire it"
        )
        value = other_value(path, field)
        job, _ = load_job(None, {f"{sections[0]}.{path}": value})
        assert value_at(started_config(service, job, tmp_path), path) == value, (
            f"{sections[0]}.{path} does not reach the {service}"
        )
        reached.append(path)
    assert reached and len(reached) > len(wired) / 2


def test_the_micro_batch_token_budget_reaches_the_trainer(tmp_path):
    job, base = load_job(None, {"algorithm.micro_batch_max_tokens": 512})
    assert TrainerConfig(**trainer_settings(job, base, tmp_path, tmp_path)).micro_batch_max_tokens == 512


def test_a_field_the_launcher_does_not_wire_and_no_section_holds_fails_the_walk():
    class Extra(TrainerConfig):
        unreachable_knob: int = 3

    assert ("unreachable_knob" in dict(leaf_fields(Extra))) and not any(
        job_field_exists(f"{section}.unreachable_knob") for section in JOB_SECTIONS["trainer"]
    )
