"""The trainer's view of the mesh from rank 0: submit prompts, stream rollouts, announce versions
(manager), the latest stored version (weights service). Every call carries a deadline; calls to
the manager ride out its restarts, and rollouts arrive exactly once."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog

from rlmesh.common.v1 import common_pb2
from rlmesh.manager.v1 import manager_pb2, manager_pb2_grpc
from rlmesh.rpc.channels import call_options, open_channel
from rlmesh.weights.v1 import weights_pb2, weights_pb2_grpc
from services.trainer.outage import ManagerOutage
from services.trainer.relayed import RelayedPayloads

log = structlog.get_logger()


class MeshClient:
    def __init__(
        self, manager_address: str, weights_address: str, rpc_timeout: float, manager_outage_seconds: float = 120.0
    ) -> None:
        self.rpc_timeout = rpc_timeout
        self.manager_outage_seconds = manager_outage_seconds
        self._manager_channel = open_channel(manager_address)
        self._weights_channel = open_channel(weights_address)
        self.manager = manager_pb2_grpc.ManagerServiceStub(self._manager_channel)
        self.weights = weights_pb2_grpc.WeightsServiceStub(self._weights_channel)
        self.relayed = RelayedPayloads(rpc_timeout, manager_outage_seconds)

    async def _call_manager(
        self, method: Callable[..., Awaitable[Any]], request: Any, landed: grpc.StatusCode | None = None
    ) -> Any:
        """A unary call to the manager, made again while the manager is unreachable. `landed` is
        the status a repeated call gets when an earlier attempt took effect though its reply was
        lost: then the call succeeded (None is returned)."""
        outage = ManagerOutage(self.manager_outage_seconds)
        call = type(request).__name__.removesuffix("Request")
        repeated = False
        while True:
            try:
                return await method(request, **call_options(self.rpc_timeout))
            except grpc.aio.AioRpcError as exc:
                if repeated and exc.code() == landed:
                    return None
                await outage.wait(exc, call)
                repeated = True

    async def manager_status(self) -> manager_pb2.GetStatusResponse:
        return await self._call_manager(self.manager.GetStatus, manager_pb2.GetStatusRequest())

    async def stored_version(self) -> int:
        """The newest version the weights service holds, -1 if none."""
        status = await self.weights.GetStatus(weights_pb2.GetStatusRequest(), **call_options(self.rpc_timeout))
        return status.latest_version

    async def cancel(self, batch_id: str, missing_ok: bool = False) -> None:
        """`missing_ok`: a batch the manager does not hold (delivered, or never submitted) is no error."""
        try:
            await self._call_manager(
                self.manager.CancelBatch,
                manager_pb2.CancelBatchRequest(batch_id=batch_id),
                landed=grpc.StatusCode.NOT_FOUND,
            )
        except grpc.aio.AioRpcError as exc:
            if not (missing_ok and exc.code() == grpc.StatusCode.NOT_FOUND):
                raise

    async def submit(
        self,
        batch_id: str,
        policy_version: int,
        prompts: list[tuple[str, list[int]] | tuple[str, list[int], common_pb2.SamplingParams]],
        n: int,
        sampling: common_pb2.SamplingParams,
        exact_version: bool = False,
        background: bool = False,
    ) -> None:
        """A prompt given with its own sampling settings (its task's) uses them instead of the batch's.
        `exact_version`: every token comes from exactly `policy_version` (held-out evaluation of that
        version); its rollouts fail with OUT_OF_RANGE once no instance serves it. `background`:
        instances decode it only with the CPU other work leaves."""
        request = manager_pb2.SubmitPromptsRequest(
            batch_id=batch_id,
            policy_version=policy_version,
            prompts=[
                manager_pb2.Prompt(
                    prompt_id=entry[0], token_ids=entry[1], n=n, sampling=entry[2] if len(entry) > 2 else None
                )
                for entry in prompts
            ],
            sampling=sampling,
            exact_version=exact_version,
            background=background,
        )
        await self._call_manager(self.manager.SubmitPrompts, request, landed=grpc.StatusCode.ALREADY_EXISTS)

    async def rollouts(
        self, batch_id: str, micro_batch_groups: int, min_groups: int, max_tokens: int, timeout: float
    ) -> AsyncIterator[list[manager_pb2.Group]]:
        """Every group of the batch exactly once, as micro-batches, across broken streams and
        manager restarts: a broken stream is opened again from the count of groups read so far,
        so a reply that was sent but never read comes again, and a group already read is dropped
        by prompt id. A stream past its deadline (`timeout`) is opened again the same way. Once
        the batch is read, the manager is told it can forget it."""
        outage = ManagerOutage(self.manager_outage_seconds)
        read = 0
        seen: set[str] = set()
        complete = False
        while not complete:
            stream = self.manager.StreamRollouts(
                manager_pb2.StreamRolloutsRequest(
                    batch_id=batch_id,
                    micro_batch_groups=micro_batch_groups,
                    min_groups=min_groups,
                    max_tokens=max_tokens,
                    resume_from=read,
                ),
                **call_options(timeout),
            )
            try:
                async for reply in stream:
                    outage.reset()
                    if reply.first_group_index != read:
                        raise RuntimeError(
                            f"batch {batch_id!r}: the manager resumed at group {reply.first_group_index}, "
                            f"not at the {read} groups read"
                        )
                    read += len(reply.groups)
                    fresh = [g for g in reply.groups if g.prompt_id not in seen]
                    seen.update(g.prompt_id for g in fresh)
                    if fresh:
                        await self.relayed.fill(fresh)
                        yield fresh
                    if reply.remaining_groups == 0:
                        complete = True
                        break
            except grpc.aio.AioRpcError as exc:
                # `timeout` bounds one stream; how long a step may wait is the caller's to decide.
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    await outage.wait(exc, "StreamRollouts")
        await self._call_manager(
            self.manager.AcknowledgeRollouts, manager_pb2.AcknowledgeRolloutsRequest(batch_id=batch_id)
        )

    async def open_sessions(
        self,
        batch_id: str,
        policy_version: int,
        prompts: list[tuple[str, list[int], common_pb2.SamplingParams]],
        n: int,
        sampling: common_pb2.SamplingParams,
        limits: manager_pb2.SessionLimits,
        task: str,
    ) -> list[manager_pb2.SessionHandle]:
        """`n` multi-turn sessions per prompt; a call whose reply was lost finds its sessions' keys again."""
        request = manager_pb2.OpenSessionsRequest(
            batch_id=batch_id,
            policy_version=policy_version,
            sampling=sampling,
            limits=limits,
            task=task,
            prompts=[
                manager_pb2.Prompt(prompt_id=prompt_id, token_ids=token_ids, n=n, sampling=own)
                for prompt_id, token_ids, own in prompts
            ],
        )
        reply = await self._call_manager(self.manager.OpenSessions, request, landed=grpc.StatusCode.ALREADY_EXISTS)
        if reply is not None:
            return list(reply.sessions)
        handles = []
        for prompt_id, _, _ in prompts:
            for index in range(n):
                session_id = f"{batch_id}/{prompt_id}/{index}"
                found = await self._call_manager(
                    self.manager.GetSession, manager_pb2.GetSessionRequest(session_id=session_id)
                )
                handles.append(
                    manager_pb2.SessionHandle(session_id=session_id, prompt_id=prompt_id, index=index, key=found.key)
                )
        return handles

    async def run_turn(self, request: manager_pb2.RunTurnRequest, wait_seconds: float) -> manager_pb2.RunTurnResponse:
        """A session's turn, generated. The call is idempotent per turn: it is made again while the
        manager is unreachable (a restarted one continues the turn from its journal) and when one
        call's deadline (`wait_seconds`) passes first, until the turn ends or the manager ends the
        session (its own turn deadline)."""
        outage = ManagerOutage(self.manager_outage_seconds)
        while True:
            try:
                return await self.manager.RunTurn(request, **call_options(wait_seconds))
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    await outage.wait(exc, "RunTurn")

    async def start_session(self, session_id: str) -> int:
        """The session's episode begins (its deadlines run from now); returns its status (OPEN, or
        how it already ended)."""
        reply = await self._call_manager(
            self.manager.StartSession, manager_pb2.StartSessionRequest(session_id=session_id)
        )
        return reply.status

    async def set_session_reward(self, session_id: str, reward: float, turn: int | None = None) -> None:
        await self._call_manager(
            self.manager.SetSessionReward,
            manager_pb2.SetSessionRewardRequest(session_id=session_id, reward=reward, turn=turn),
        )

    async def close_session(self, session_id: str, status: int, detail: str = "") -> int:
        """Returns the status the session ended with (the manager's, if it ended it first)."""
        reply = await self._call_manager(
            self.manager.CloseSession,
            manager_pb2.CloseSessionRequest(session_id=session_id, status=status, detail=detail),
        )
        return reply.status

    async def report_step(self, batch_id: str, step_seconds: float, wait_seconds: float) -> manager_pb2.StageBalance:
        reply = await self._call_manager(
            self.manager.ReportTrainingStep,
            manager_pb2.ReportTrainingStepRequest(
                batch_id=batch_id, step_seconds=step_seconds, wait_seconds=wait_seconds
            ),
        )
        return reply.stage_balance

    async def announce(self, version: int) -> None:
        """Tells the manager a version is published (after every trainer rank uploaded its shards)."""
        await self._call_manager(self.manager.PublishVersion, manager_pb2.PublishVersionRequest(version=version))

    async def close(self) -> None:
        await self._manager_channel.close()
        await self._weights_channel.close()
        await self.relayed.close()
