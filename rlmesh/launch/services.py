"""What each service of a mesh is started with: its module, its address and the environment
settings that carry the plan's values to it."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

from rlmesh.launch.plan import LaunchPlan
from rlmesh.launch.ports import free_port, metrics_setting, port_of
from rlmesh.launch.processes import ServiceSpec, torchrun_args
from rlmesh.models.families import check_model_dir

VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
"""The vLLM engine's own virtualenv (`make setup-vllm`)."""
SERVICE_MODULES = (
    "services.manager",
    "services.manager.relay",
    "services.weights",
    "services.rollout",
    "services.trainer",
)
"""What each service runs as `python -m`."""
HELPER_MODULES = (
    "services.rollout.torch.tp_worker",
    "services.trainer.ranks.reference",
    "services.trainer.episodes.process",
    "services.manager.gateway.main",
)
"""What the services start as helpers (`python -m`), which a warm fork server forks for them."""
MANAGER_JOURNAL_FILE = "manager-journal.sqlite"
"""The manager's journal in the output folder: a restarted manager takes up its state from it."""
RELAY_JOURNAL_FILES = "relay-{index}-payloads.log"
"""Each relay shard's journal in the output folder: a restarted shard holds the tokens it reported."""


def manager_spec(plan: LaunchPlan) -> ServiceSpec:
    """On the same port and journal every time: a restarted manager takes up where the last one stopped."""
    return ServiceSpec(
        "manager",
        "services.manager",
        plan.manager_address,
        {
            "RLMESH_MANAGER_SERVER__HOST": plan.manager_host,
            "RLMESH_MANAGER_SERVER__PORT": port_of(plan.manager_address),
            "RLMESH_MANAGER_MAX_STALENESS": str(plan.job.algorithm.max_staleness),
            "RLMESH_MANAGER_JOURNAL_PATH": str(plan.output_dir / MANAGER_JOURNAL_FILE),
            "RLMESH_MANAGER_WEIGHTS_ADDRESS": plan.weights_address,
            "RLMESH_MANAGER_GATEWAY_PORT": port_of(plan.gateway_address),
            "RLMESH_MANAGER_MODEL_DIR": str(plan.model_dir),
            "RLMESH_MANAGER_RELAY_ADDRESSES": ",".join(plan.relay_addresses),
            **metrics_setting("RLMESH_MANAGER", plan.manager_address),
            **plan.security_settings("manager"),
        },
    )


def relay_spec(plan: LaunchPlan, index: int) -> ServiceSpec:
    """A relay shard: a process of the manager service, with the manager's certificate and role, on
    the same port and journal every time."""
    address = plan.relay_addresses[index]
    return ServiceSpec(
        f"relay-{index}",
        "services.manager.relay",
        address,
        {
            "RLMESH_RELAY_SERVER__HOST": plan.manager_host,
            "RLMESH_RELAY_SERVER__PORT": port_of(address),
            "RLMESH_RELAY_JOURNAL_PATH": str(plan.output_dir / RELAY_JOURNAL_FILES.format(index=index)),
            **plan.security_settings("manager", "RLMESH_RELAY_"),
        },
    )


def weights_spec(plan: LaunchPlan) -> ServiceSpec:
    return ServiceSpec(
        "weights",
        "services.weights",
        plan.weights_address,
        {
            "RLMESH_WEIGHTS_SERVER__HOST": plan.mesh.host,
            "RLMESH_WEIGHTS_SERVER__PORT": port_of(plan.weights_address),
            "RLMESH_WEIGHTS_MANAGER_ADDRESS": plan.manager_address,
            **metrics_setting("RLMESH_WEIGHTS", plan.weights_address),
            **plan.security_settings("weights"),
        },
    )


def rollout_spec(plan: LaunchPlan, index: int) -> ServiceSpec:
    address = plan.rollout_address(index)
    link = plan.netns_link(index)
    return ServiceSpec(
        f"rollout-{index}",
        "services.rollout",
        address,
        {
            "RLMESH_ROLLOUT_SERVER__HOST": plan.rollout_host(index),
            "RLMESH_ROLLOUT_SERVER__PORT": port_of(address),
            "RLMESH_ROLLOUT_INSTANCE_ID": f"rollout-{index}",
            "RLMESH_ROLLOUT_MANAGER_ADDRESS": plan.manager_address,
            "RLMESH_ROLLOUT_ENGINE__MODEL_DIR": str(plan.model_dir),
            "RLMESH_ROLLOUT_ENGINE__DTYPE": plan.job.model.dtype,
            # Each rank starts a Mooncake transfer engine only when pushes go through one.
            "RLMESH_ROLLOUT_TRANSFER__MOONCAKE": "true" if plan.job.weights.backend == "mooncake" else "false",
            **metrics_setting("RLMESH_ROLLOUT", address),
            **plan.security_settings("rollout"),
        },
        python=str(VLLM_PYTHON) if plan.job.rollout.engine.kind == "vllm" else None,
        netns=link.namespace if link is not None else None,
    )


def trainer_spec(plan: LaunchPlan) -> ServiceSpec:
    """One trainer process, or torchrun with `trainer_ranks` of them (rank 0 serves the port), on a
    rendezvous port free at the time of the call."""
    mesh = plan.mesh
    launcher = torchrun_args(mesh.trainer_ranks, free_port(mesh.host), mesh.host) if mesh.trainer_ranks > 1 else None
    return ServiceSpec(
        "trainer",
        "services.trainer",
        plan.trainer_address,
        {
            "RLMESH_TRAINER_SERVER__HOST": mesh.host,
            "RLMESH_TRAINER_SERVER__PORT": port_of(plan.trainer_address),
            "RLMESH_TRAINER_MANAGER_ADDRESS": plan.manager_address,
            "RLMESH_TRAINER_WEIGHTS_ADDRESS": plan.weights_address,
            "RLMESH_TRAINER_GATEWAY_ADDRESS": plan.gateway_address,
            "RLMESH_TRAINER_MODEL_DIR": str(plan.model_dir),
            "RLMESH_TRAINER_OUTPUT_DIR": str(plan.output_dir),
            "RLMESH_TRAINER_STEPS": str(plan.steps),
            **metrics_setting("RLMESH_TRAINER", plan.trainer_address),
            **plan.security_settings("trainer"),
        },
        launcher=launcher,
        args=["--config", str(plan.trainer_config)] if plan.trainer_config else None,
    )


def forked_modules(plan: LaunchPlan) -> list[str]:
    """What the fork server imports: the entry modules of the services it can start for this plan,
    and, for the trainer or the rollout, what building the model imports (transformers imports a
    family's classes on first use: seconds in every process); verifiers, for a job with a verifiers
    environment (the job's check and the trainer load its taskset: 7 s of imports each)."""
    specs = (manager_spec(plan), weights_spec(plan), rollout_spec(plan, 0), trainer_spec(plan))
    modules = [f"{spec.module}.__main__" for spec in specs if spec.forkable]
    if any(module.startswith(("services.trainer", "services.rollout")) for module in modules):
        modules += ["transformers.initialization", check_model_dir(plan.model_dir).modeling_module]
    # Not installed: the job's check says so, naming the task.
    if any(task.environment is not None and task.environment.verifiers for task in plan.job.tasks) and find_spec(
        "verifiers"
    ):
        modules.append("verifiers.v1")
    return modules
