"""A remote environment and a remote verifier are the user's servers, outside the mesh: run through
the trainer's own code (the task built from its config, an episode driven, its transcript scored)
in a process holding the trainer's secret, each receives the credential its task configures and
no mesh role's secret."""

import asyncio
import json

import grpc
import pytest

from rlmesh.common.v1 import common_pb2
from rlmesh.environment.v1 import environment_pb2, environment_pb2_grpc
from rlmesh.models.tokenizer import IM_END_TOKEN, load_hf_tokenizer
from rlmesh.reward.v1 import reward_pb2, reward_pb2_grpc
from rlmesh.rewards.base import RewardItem
from rlmesh.rpc.authz import ROLES
from rlmesh.rpc.channels import use_secret
from rlmesh.rpc.credentials import peer_secrets
from rlmesh.tasks.base import TaskPrompt
from rlmesh.tasks.build import TaskError, TaskMixture, build_task
from rlmesh.tasks.config import TaskConfig
from services.trainer.episodes.driver import EpisodeDriver, open_sessions
from services.trainer.episodes.spec import episode_specs
from tests.support.credentials import TEST_SECRETS, play_every_role, role_secret

ENVIRONMENT_TOKEN = "environment-token-of-the-user"
VERIFIER_TOKEN = "verifier-token-of-the-user"


class Recorded:
    """The metadata of every call a server got, by method."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, str]]] = []

    def record(self, method: str, context) -> None:
        self.calls.append((method, {key: value for key, value in context.invocation_metadata()}))


class Environment(environment_pb2_grpc.EnvironmentServiceServicer):
    def __init__(self, recorded: Recorded) -> None:
        self.recorded = recorded

    async def Reset(self, request, context):
        self.recorded.record("Reset", context)
        return environment_pb2.ResetResponse(messages=[environment_pb2.ChatMessage(role="user", content="Say hi.")])

    async def Step(self, request, context):
        self.recorded.record("Step", context)
        return environment_pb2.StepResponse(done=True, reward=1.0)

    async def Close(self, request, context):
        self.recorded.record("Close", context)
        return environment_pb2.CloseResponse()


class Verifier(reward_pb2_grpc.RewardServiceServicer):
    def __init__(self, recorded: Recorded) -> None:
        self.recorded = recorded

    async def Score(self, request, context):
        self.recorded.record("Score", context)
        return reward_pb2.ScoreResponse(
            results=[reward_pb2.ScoreResult(sample_id=i.sample_id, reward=1.0) for i in request.items]
        )


@pytest.fixture
async def user_server():
    """The user's environment and verifier on one loopback port, with no mesh authorization."""
    recorded = Recorded()
    server = grpc.aio.server()
    environment_pb2_grpc.add_EnvironmentServiceServicer_to_server(Environment(recorded), server)
    reward_pb2_grpc.add_RewardServiceServicer_to_server(Verifier(recorded), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", recorded
    finally:
        await server.stop(None)


@pytest.fixture
def as_the_trainer():
    """Every call this process makes carries a role's secret, as the trainer's calls carry its own:
    the mesh's services (in this process too) get the role they expect, any other call the trainer's."""
    peers = peer_secrets(TEST_SECRETS)
    use_secret(lambda method: peers(method) or role_secret("trainer"))
    yield
    play_every_role()


def task_config(tmp_path, address: str) -> TaskConfig:
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"question": f"Say {i}."}) + "\n" for i in range(4)))
    (tmp_path / "environment.token").write_text(ENVIRONMENT_TOKEN + "\n")
    return TaskConfig.model_validate(
        {
            "name": "users",
            "dataset": {"path": "rows.jsonl", "fields": {"prompt": "question"}},
            "eval": {"holdout": 1},
            "reward": {"remote": address, "remote_credential": "env:USERS_VERIFIER_TOKEN"},
            "environment": {"remote": address, "remote_credential": "file:environment.token", "max_turns": 2},
        }
    ).resolve_paths(tmp_path)


async def test_a_remote_environment_and_verifier_get_their_own_credential_and_no_roles_secret(
    chat_mesh, chat_model_dir, tmp_path, user_server, as_the_trainer, monkeypatch
):
    address, recorded = user_server
    built, client = chat_mesh
    monkeypatch.setenv("USERS_VERIFIER_TOKEN", VERIFIER_TOKEN)
    tokenizer = load_hf_tokenizer(chat_model_dir)
    task = build_task(task_config(tmp_path, address), tokenizer, 0, [str(tmp_path)])
    stop = tokenizer.convert_tokens_to_ids(IM_END_TOKEN)
    spec = episode_specs(TaskMixture([task], 0), tokenizer, [stop], 512, str(tmp_path))["users"]
    params = common_pb2.SamplingParams(temperature=1.0, max_tokens=6, stop_token_ids=[stop])
    [handle] = await open_sessions(client, spec, "users", 0, [("p", [], params)], 1)
    driver = EpisodeDriver(client, threads=2, on_failure=lambda exc: asyncio.sleep(0))
    try:
        status, reason = await driver.run_episode(spec, handle, TaskPrompt("p", text="Say hi."))
    finally:
        await driver.close()
    assert reason == "", reason
    [result] = await task.reward.score([RewardItem("users/p/0", "Say hi.", "hi", {}, [1, 2])])
    assert result.reward == 1.0 and not result.error
    assert {method for method, _ in recorded.calls} == {"Reset", "Step", "Close", "Score"}
    secrets = {role: role_secret(role) for role in ROLES}
    for method, metadata in recorded.calls:
        leaked = [role for role, secret in secrets.items() if any(secret in value for value in metadata.values())]
        assert leaked == [], f"{method} was sent the secret of {leaked}"
        token = VERIFIER_TOKEN if method == "Score" else ENVIRONMENT_TOKEN
        assert metadata.get("authorization") == f"Bearer {token}", (method, metadata)


def test_a_credential_that_cannot_be_read_stops_the_task_naming_it(tmp_path, chat_model_dir, monkeypatch):
    monkeypatch.delenv("USERS_VERIFIER_TOKEN", raising=False)
    tokenizer = load_hf_tokenizer(chat_model_dir)
    with pytest.raises(
        TaskError,
        match="reward.remote_credential = 'env:USERS_VERIFIER_TOKEN': the environment variable "
        "USERS_VERIFIER_TOKEN is not set",
    ):
        build_task(task_config(tmp_path, "127.0.0.1:1"), tokenizer, 0, [str(tmp_path)])
    with pytest.raises(ValueError, match="must be env:NAME"):
        TaskConfig.model_validate(
            {"name": "t", "kind": "increment", "reward": {"remote": "h:1", "remote_credential": "trainer.secret"}}
        )
    with pytest.raises(ValueError, match="give remote too"):
        TaskConfig.model_validate(
            {"name": "t", "kind": "increment", "environment": {"builtin": "calculator", "remote_credential": "env:X"}}
        )
