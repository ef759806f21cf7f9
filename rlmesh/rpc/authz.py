"""Who may call what: the roles of the mesh and, for every RPC of every contract, the roles allowed
to call it. One table, read by every server's interceptor and by the docs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, get_args

Role = Literal["trainer", "instance", "weights", "manager", "operator", "observer"]
ROLES: tuple[Role, ...] = get_args(Role)
ROLE_DUTIES: Mapping[Role, str] = {
    "trainer": "the trainer's ranks: submit prompts, take rollouts, upload weights, publish versions",
    "instance": "a rollout instance: register, heartbeat, deregister; drain itself (a pod's preStop hook)",
    "weights": "the weight-transfer service: list instances, push weights into them",
    "manager": "the rollout manager: run, abort and drain generation on instances; check stored versions; "
    "its OpenAI gateway runs sessions' turns",
    "operator": "a person or tool running the mesh: status, scale, drain, pause",
    "observer": "read-only: status and metrics",
}

OPEN_SERVICES = frozenset(
    {"grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"}
)
"""Served to anyone: health is what probes and supervisors poll (Kubernetes' gRPC probe carries no
credential), and reflection describes only the public contracts."""

_MANAGER = "rlmesh.manager.v1.ManagerService"
_RELAY = "rlmesh.manager.v1.RelayService"
_ROLLOUT = "rlmesh.rollout.v1.RolloutService"
_WEIGHTS = "rlmesh.weights.v1.WeightsService"
_TRAINER = "rlmesh.trainer.v1.TrainerService"
_REWARD = "rlmesh.reward.v1.RewardService"
_ENVIRONMENT = "rlmesh.environment.v1.EnvironmentService"

_STATUS_READERS: frozenset[Role] = frozenset({"operator", "observer"})
_SESSION_RUNNERS: frozenset[Role] = frozenset({"trainer", "manager"})
"""The trainer's episodes, and the manager's own OpenAI gateway (a process of the manager service
calling it with the manager's credential) on behalf of a harness whose session key it checked."""

AUTHORIZED: Mapping[str, frozenset[Role]] = {
    f"/{_MANAGER}/RegisterInstance": frozenset({"instance"}),
    f"/{_MANAGER}/Heartbeat": frozenset({"instance"}),
    f"/{_MANAGER}/DeregisterInstance": frozenset({"instance"}),
    f"/{_MANAGER}/ListInstances": frozenset({"weights"}) | _STATUS_READERS,
    f"/{_MANAGER}/PublishVersion": frozenset({"trainer"}),
    f"/{_MANAGER}/SubmitPrompts": frozenset({"trainer"}),
    f"/{_MANAGER}/StreamRollouts": frozenset({"trainer"}),
    f"/{_MANAGER}/GetStatus": frozenset({"trainer"}) | _STATUS_READERS,
    f"/{_MANAGER}/CancelBatch": frozenset({"trainer"}),
    f"/{_MANAGER}/TakeReadyGroups": frozenset({"trainer"}),
    f"/{_MANAGER}/AcknowledgeRollouts": frozenset({"trainer"}),
    f"/{_MANAGER}/ReportTrainingStep": frozenset({"trainer"}),
    f"/{_MANAGER}/OpenSessions": frozenset({"trainer"}),
    f"/{_MANAGER}/RunTurn": _SESSION_RUNNERS,
    f"/{_MANAGER}/StreamTurn": _SESSION_RUNNERS,
    f"/{_MANAGER}/SetSessionReward": _SESSION_RUNNERS,
    f"/{_MANAGER}/CloseSession": frozenset({"trainer"}),
    f"/{_MANAGER}/StartSession": frozenset({"trainer"}),
    f"/{_MANAGER}/GetSession": _SESSION_RUNNERS,
    # Every opening session's key: the manager's own gateway only.
    f"/{_MANAGER}/WatchSessions": frozenset({"manager"}),
    # A relay shard is a process of the manager service: the manager hands it streams, the trainer
    # fetches the tokens it holds.
    f"/{_RELAY}/Relay": frozenset({"manager"}),
    f"/{_RELAY}/WatchRelay": frozenset({"manager"}),
    f"/{_RELAY}/FetchSamples": frozenset({"trainer"}),
    f"/{_ROLLOUT}/Generate": frozenset({"manager"}),
    f"/{_ROLLOUT}/GenerateMany": frozenset({"manager"}),
    f"/{_ROLLOUT}/Abort": frozenset({"manager"}),
    f"/{_ROLLOUT}/GetInfo": frozenset({"weights", "manager"}) | _STATUS_READERS,
    f"/{_ROLLOUT}/BeginWeightUpdate": frozenset({"weights"}),
    f"/{_ROLLOUT}/PushWeightChunks": frozenset({"weights"}),
    f"/{_ROLLOUT}/CommitWeightUpdate": frozenset({"weights"}),
    f"/{_ROLLOUT}/PauseGeneration": frozenset({"manager", "operator"}),
    f"/{_ROLLOUT}/ResumeGeneration": frozenset({"manager", "operator"}),
    f"/{_ROLLOUT}/Drain": frozenset({"manager", "operator", "instance"}),
    f"/{_WEIGHTS}/UploadWeights": frozenset({"trainer"}),
    f"/{_WEIGHTS}/UploadShards": frozenset({"trainer"}),
    f"/{_WEIGHTS}/GetStatus": frozenset({"trainer", "manager"}) | _STATUS_READERS,
    f"/{_TRAINER}/GetTrainingStatus": _STATUS_READERS,
}

USER_CONTRACTS = frozenset({_REWARD, _ENVIRONMENT})
"""Contracts the user's code serves (a remote verifier, a remote environment): outside the mesh,
so in no role's table. A call to one carries the credential its task configures
(`reward.remote_credential`, `environment.remote_credential`) or none, never a role's secret or
certificate (docs/security.md)."""


def service_of(method: str) -> str:
    """ "rlmesh.manager.v1.ManagerService" of "/rlmesh.manager.v1.ManagerService/GetStatus"."""
    return method.lstrip("/").split("/", 1)[0]


def allowed_roles(method: str) -> frozenset[Role]:
    """The roles that may call `method` (a full name, "/package.Service/Method"); none for a
    method the table does not name, so that a new RPC is closed until it is given an entry."""
    return AUTHORIZED.get(method, frozenset())
