"""An environment served behind `rlmesh.environment.v1.EnvironmentService`, in any language: one
client per episode over a channel its task shares, every call under a deadline and with the task's
own credential (never a mesh role's), and every refusal or malformed answer an EnvironmentFailure
that ends the episode."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import grpc

from rlmesh.environment.v1 import environment_pb2, environment_pb2_grpc
from rlmesh.environments.base import Action, EnvironmentFailure, StepResult, Tokens
from rlmesh.rpc.channels import call_options, open_user_channel


class EnvironmentChannel:
    """The channel of one task's environment service, opened on first use (a grpc.aio channel
    belongs to the event loop it was made in); `bearer_token` (the task's
    environment.remote_credential) goes with every call when given."""

    def __init__(self, address: str, task: str, timeout_seconds: float, bearer_token: str = "") -> None:
        self.address, self.task, self.timeout = address, task, timeout_seconds
        self.bearer_token = bearer_token
        self._channel: grpc.aio.Channel | None = None
        self._stub: environment_pb2_grpc.EnvironmentServiceStub | None = None

    @property
    def stub(self) -> environment_pb2_grpc.EnvironmentServiceStub:
        if self._stub is None:
            self._channel = open_user_channel(self.address, self.bearer_token)
            self._stub = environment_pb2_grpc.EnvironmentServiceStub(self._channel)
        return self._stub

    def episode(self, episode_id: str) -> RemoteEnvironment:
        return RemoteEnvironment(self, episode_id)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None


class RemoteEnvironment:
    """One episode of a remote environment, with the Environment interface (async)."""

    def __init__(self, channel: EnvironmentChannel, episode_id: str) -> None:
        self.channel, self.episode_id = channel, episode_id
        self.turn = 0

    async def _call(self, method: str, request: Any) -> Any:
        try:
            return await getattr(self.channel.stub, method)(request, **call_options(self.channel.timeout))
        except grpc.aio.AioRpcError as exc:
            raise EnvironmentFailure(
                f"environment service at {self.channel.address} answered {method} with "
                f"{exc.code().name}: {exc.details()}"
            ) from exc

    async def reset(self, row: Mapping[str, Any]) -> Any:
        reply = await self._call(
            "Reset",
            environment_pb2.ResetRequest(
                episode_id=self.episode_id, task=self.channel.task, row_json=json.dumps(dict(row), default=str)
            ),
        )
        return observation(reply.messages, reply.token_ids, "Reset")

    async def step(self, action: Action) -> StepResult:
        request = environment_pb2.StepRequest(
            episode_id=self.episode_id,
            text=action.text,
            token_ids=action.token_ids,
            truncated=action.truncated,
            turn=self.turn,
            tool_calls=[
                environment_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in action.tool_calls
            ],
        )
        self.turn += 1
        reply = await self._call("Step", request)
        messages = observation(reply.messages, reply.token_ids, "Step") if (reply.messages or reply.token_ids) else []
        return StepResult(messages, reply.reward if reply.HasField("reward") else None, reply.done)

    async def close(self) -> None:
        await self._call("Close", environment_pb2.CloseRequest(episode_id=self.episode_id))


def observation(messages, token_ids, where: str) -> Any:
    if messages and token_ids:
        raise EnvironmentFailure(f"the environment's {where} gave both messages and token_ids: give one")
    if token_ids:
        return Tokens(list(token_ids))
    return [
        {
            k: v
            for k, v in (("role", m.role), ("content", m.content), ("tool_call_id", m.tool_call_id), ("name", m.name))
            if v
        }
        for m in messages
    ]
