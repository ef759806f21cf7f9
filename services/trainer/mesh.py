"""The trainer's view of the mesh from rank 0: submit prompts, stream rollouts, announce versions
(manager), the latest stored version (weights service). Every call carries a deadline."""

from __future__ import annotations

from collections.abc import AsyncIterator

from rlmesh.common.v1 import common_pb2
from rlmesh.manager.v1 import manager_pb2, manager_pb2_grpc
from rlmesh.rpc import call_options, open_channel
from rlmesh.weights.v1 import weights_pb2, weights_pb2_grpc


class MeshClient:
    def __init__(self, manager_address: str, weights_address: str, rpc_timeout: float) -> None:
        self.rpc_timeout = rpc_timeout
        self._manager_channel = open_channel(manager_address)
        self._weights_channel = open_channel(weights_address)
        self.manager = manager_pb2_grpc.ManagerServiceStub(self._manager_channel)
        self.weights = weights_pb2_grpc.WeightsServiceStub(self._weights_channel)

    async def manager_status(self) -> manager_pb2.GetStatusResponse:
        return await self.manager.GetStatus(manager_pb2.GetStatusRequest(), **call_options(self.rpc_timeout))

    async def stored_version(self) -> int:
        """The newest version the weights service holds, -1 if none."""
        status = await self.weights.GetStatus(weights_pb2.GetStatusRequest(), **call_options(self.rpc_timeout))
        return status.latest_version

    async def cancel(self, batch_id: str) -> None:
        await self.manager.CancelBatch(manager_pb2.CancelBatchRequest(batch_id=batch_id), **call_options(self.rpc_timeout))

    async def submit(self, batch_id: str, policy_version: int,
                     prompts: list[tuple[str, list[int]] | tuple[str, list[int], common_pb2.SamplingParams]], n: int,
                     sampling: common_pb2.SamplingParams) -> None:
        """A prompt given with its own sampling settings (its task's) uses them instead of the batch's."""
        await self.manager.SubmitPrompts(
            manager_pb2.SubmitPromptsRequest(
                batch_id=batch_id,
                policy_version=policy_version,
                prompts=[manager_pb2.Prompt(prompt_id=entry[0], token_ids=entry[1], n=n,
                                            sampling=entry[2] if len(entry) > 2 else None) for entry in prompts],
                sampling=sampling,
            ),
            **call_options(self.rpc_timeout),
        )

    async def rollouts(self, batch_id: str, micro_batch_groups: int, min_groups: int, max_tokens: int, timeout: float) -> AsyncIterator[list[manager_pb2.Group]]:
        stream = self.manager.StreamRollouts(
            manager_pb2.StreamRolloutsRequest(
                batch_id=batch_id, micro_batch_groups=micro_batch_groups, min_groups=min_groups, max_tokens=max_tokens
            ),
            **call_options(timeout),
        )
        async for reply in stream:
            yield list(reply.groups)

    async def report_step(self, batch_id: str, step_seconds: float, wait_seconds: float) -> manager_pb2.StageBalance:
        reply = await self.manager.ReportTrainingStep(
            manager_pb2.ReportTrainingStepRequest(batch_id=batch_id, step_seconds=step_seconds, wait_seconds=wait_seconds),
            **call_options(self.rpc_timeout),
        )
        return reply.stage_balance

    async def announce(self, version: int) -> None:
        """Tells the manager a version is published (after every trainer rank uploaded its shards)."""
        await self.manager.PublishVersion(manager_pb2.PublishVersionRequest(version=version), **call_options(self.rpc_timeout))

    async def close(self) -> None:
        await self._manager_channel.close()
        await self._weights_channel.close()

