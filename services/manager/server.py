"""The ManagerService servicer: parses and checks each call, has the state do it and the dispatcher
act on it, and replies."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import NoReturn

import grpc
import structlog

from rlmesh.errors import FailedPrecondition, InvalidArgument
from rlmesh.manager.v1 import manager_pb2, manager_pb2_grpc
from rlmesh.rpc.prometheus import Families
from services.manager.config import ManagerConfig
from services.manager.dispatcher import Changes, Dispatcher
from services.manager.domain.conversations import conversation_from_proto, conversation_to_proto
from services.manager.domain.records import Limits, SampleRequest, stream_of
from services.manager.domain.registry import WrongIncarnation
from services.manager.domain.state import ManagerState
from services.manager.domain.trajectories import segment_from_proto, trajectory
from services.manager.journal import Journal, NoJournal
from services.manager.replies import balance_to_proto, group_to_proto, instance_status, turn_response
from services.manager.session_feed import SessionFeed
from services.manager.stored_versions import StoredVersions
from services.manager.turns import TurnRunner

log = structlog.get_logger()


async def refuse_incarnation(context: grpc.aio.ServicerContext, exc: WrongIncarnation) -> NoReturn:
    log.warning("call from another incarnation refused", error=str(exc))
    await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))


class ManagerServicer(manager_pb2_grpc.ManagerServiceServicer):
    def __init__(
        self,
        state: ManagerState,
        dispatcher: Dispatcher,
        changes: Changes,
        config: ManagerConfig,
        journal: Journal | NoJournal,
        stored_versions: StoredVersions,
        authorization: str,
    ) -> None:
        self.state = state
        self.stored_versions = stored_versions
        self.authorization = authorization
        """How callers prove their role ("off" when --insecure), as GetStatus reports it."""
        self.dispatcher = dispatcher
        self.changes = changes
        self.config = config
        self.journal = journal
        self.turns = TurnRunner(state, dispatcher, changes, journal)
        self.session_feed: SessionFeed[manager_pb2.WatchSessionsResponse] = SessionFeed()
        state.sessions.forgotten = self._sessions_forgotten

    def _sessions_forgotten(self, session_ids: list[str]) -> None:
        # The gateway drops its views of them: what it keeps is bounded by the sessions alive.
        if self.session_feed:
            self.session_feed.publish(manager_pb2.WatchSessionsResponse(forgotten=session_ids))

    def _changed(self) -> None:
        self.dispatcher.dispatch()
        self.changes.notify()

    def _durable(self) -> None:
        """What the reply about to go out confirms is in the journal first."""
        self.journal.flush(self.state)

    async def RegisterInstance(self, request, context):
        instance, requeued = self.state.register(
            request.instance_id,
            request.address,
            request.weight_version,
            request.max_batch_size,
            time.monotonic(),
            request.preemptible,
            request.incarnation_token,
            request.saturation_batch_size,
        )
        self.dispatcher.cancel(requeued)
        self.dispatcher.close_streams(instance.instance_id, keep_incarnation=instance.incarnation)
        log.info(
            "instance registered",
            instance_id=request.instance_id,
            address=request.address,
            incarnation=instance.incarnation,
            weight_version=request.weight_version,
            preemptible=request.preemptible,
            saturation_batch_size=request.saturation_batch_size,
        )
        self._durable()
        self._changed()
        return manager_pb2.RegisterInstanceResponse(
            lease_seconds=self.config.lease_seconds,
            heartbeat_interval_seconds=self.config.heartbeat_interval_seconds,
            incarnation_token=instance.token,
        )

    async def Heartbeat(self, request, context):
        before = self.state.instances.get(request.instance_id)
        version_before = before.weight_version if before else None
        draining_before = before.draining if before else False
        try:
            self.state.heartbeat(
                request.instance_id,
                request.weight_version,
                time.monotonic(),
                request.draining,
                token=request.incarnation_token,
            )
        except WrongIncarnation as exc:
            await refuse_incarnation(context, exc)
        if request.draining and not draining_before:
            log.info("instance draining; no new work for it", instance_id=request.instance_id)
        version = self.state.instances[request.instance_id].weight_version
        if version_before != version:
            log.info("instance serves a new version", instance_id=request.instance_id, weight_version=version)
            self._changed()
        return manager_pb2.HeartbeatResponse(lease_seconds=self.config.lease_seconds)

    async def DeregisterInstance(self, request, context):
        instance = self.state.instances.get(request.instance_id)
        try:
            requeued = self.state.deregister(request.instance_id, request.incarnation_token, time.monotonic())
        except WrongIncarnation as exc:
            await refuse_incarnation(context, exc)
        self.dispatcher.cancel(requeued)
        self.dispatcher.close_streams(request.instance_id)
        await self.dispatcher.forget_address(instance.address)
        log.info(
            "instance deregistered",
            instance_id=request.instance_id,
            incarnation=instance.incarnation,
            requeued=len(requeued),
        )
        self._durable()
        self._changed()
        return manager_pb2.DeregisterInstanceResponse(requeued_requests=len(requeued))

    async def ListInstances(self, request, context):
        now = time.monotonic()
        return manager_pb2.ListInstancesResponse(
            instances=[instance_status(i, now) for i in self.state.instances.values()]
        )

    async def PublishVersion(self, request, context):
        if request.version > self.state.published_version:
            await self.stored_versions.check_held(request.version)
        self.state.publish(request.version)
        self._durable()
        self._changed()
        return manager_pb2.PublishVersionResponse(version=self.state.published_version)

    async def SubmitPrompts(self, request, context):
        if not request.HasField("sampling"):
            raise InvalidArgument("sampling is required")
        queued = self.state.submit(
            request.batch_id,
            request.policy_version,
            [
                (p.prompt_id, list(p.token_ids), p.n, p.sampling if p.HasField("sampling") else None)
                for p in request.prompts
            ],
            request.sampling,
            exact_version=request.exact_version,
            background=request.background,
        )
        self._durable()
        self._changed()
        return manager_pb2.SubmitPromptsResponse(accepted_prompts=len(request.prompts), queued_samples=queued)

    def _check_starvation(self, batch_id: str) -> None:
        starved = self.state.starved_seconds(time.monotonic())
        if starved > self.config.no_instance_timeout_seconds:
            batch = self.state.batches.get(batch_id)
            unfinished = batch.unfinished if batch else 0
            raise FailedPrecondition(
                f"no rollout instance has been registered for {starved:.0f} s "
                f"(limit {self.config.no_instance_timeout_seconds:.0f} s); batch {batch_id!r} has "
                f"{unfinished} unfinished samples, kept until an instance joins"
            )

    async def StreamRollouts(self, request, context) -> AsyncIterator[manager_pb2.StreamRolloutsResponse]:
        if request.micro_batch_groups < 1:
            raise InvalidArgument("micro_batch_groups must be at least 1")
        position = request.resume_from
        while True:
            taken = self.state.take_micro_batch(
                request.batch_id, request.micro_batch_groups, request.min_groups, request.max_tokens, position=position
            )
            if taken is None:
                self._check_starvation(request.batch_id)
                await self.changes.wait(timeout=1.0)
                continue
            groups, remaining = taken
            self._durable()
            # A reply the reader never gets is sent again when it resumes from its count of groups read.
            yield manager_pb2.StreamRolloutsResponse(
                groups=[group_to_proto(g, self.state.sessions.sessions) for g in groups],
                remaining_groups=remaining,
                first_group_index=position,
            )
            position += len(groups)
            if remaining == 0:
                return

    async def CancelBatch(self, request, context):
        requests = self._requests_of(request.batch_id)
        cancelled = self.state.cancel_batch(request.batch_id)
        self.dispatcher.release(requests)
        self._durable()
        log.info("batch cancelled", batch_id=request.batch_id, unfinished_samples=cancelled)
        self._changed()
        return manager_pb2.CancelBatchResponse(unfinished_samples=cancelled)

    async def TakeReadyGroups(self, request, context):
        groups, remaining = self.state.take_ready(request.batch_id, position=request.resume_from)
        self._durable()
        return manager_pb2.TakeReadyGroupsResponse(
            groups=[group_to_proto(g, self.state.sessions.sessions) for g in groups],
            remaining_groups=remaining,
            first_group_index=request.resume_from,
        )

    async def AcknowledgeRollouts(self, request, context):
        requests = self._requests_of(request.batch_id)
        forgotten = self.state.acknowledge(request.batch_id)
        if forgotten:
            self.dispatcher.release(requests)
        return manager_pb2.AcknowledgeRolloutsResponse(forgotten=forgotten)

    def _requests_of(self, batch_id: str) -> list[SampleRequest]:
        batch = self.state.batches.get(batch_id)
        return [r for group in batch.groups.values() for r in group] if batch is not None else []

    async def ReportTrainingStep(self, request, context):
        balance = self.state.report_training_step(request.batch_id, request.step_seconds, request.wait_seconds)
        log.info(
            "stage balance",
            batch_id=request.batch_id,
            recommended_rollout_instances=balance.recommended_rollout_instances,
            offload_fraction=round(balance.offload_fraction, 3),
            local_window_seconds=round(balance.local_window_seconds, 3),
        )
        return manager_pb2.ReportTrainingStepResponse(stage_balance=balance_to_proto(balance))

    async def OpenSessions(self, request, context):
        if not request.HasField("sampling"):
            raise InvalidArgument("sampling is required")
        limits = request.limits
        opened = self.state.open_sessions(
            request.batch_id,
            request.policy_version,
            [
                (p.prompt_id, list(p.token_ids), p.n, p.sampling if p.HasField("sampling") else None)
                for p in request.prompts
            ],
            request.sampling,
            Limits(
                limits.max_turns,
                limits.max_total_tokens,
                limits.turn_deadline_seconds,
                limits.step_deadline_seconds,
                limits.session_deadline_seconds,
                wait_for_start=limits.wait_for_start,
                refuse_agent_rewards=limits.refuse_agent_rewards,
                refuse_breaks=limits.refuse_breaks,
            ),
        )
        log.info("sessions opened", batch_id=request.batch_id, task=request.task, sessions=len(opened))
        self._durable()
        if self.session_feed:  # someone watches (the gateway)
            self.session_feed.publish(
                manager_pb2.WatchSessionsResponse(
                    sessions=[
                        manager_pb2.OpenedSession(
                            session_id=s.session_id,
                            key=s.key,
                            sampling=s.sampling,
                            token_ids=stream_of(s.segments),
                            refuse_agent_rewards=s.limits.refuse_agent_rewards,
                            refuse_breaks=s.limits.refuse_breaks,
                        )
                        for s in opened
                    ]
                )
            )
        return manager_pb2.OpenSessionsResponse(
            sessions=[
                manager_pb2.SessionHandle(
                    session_id=s.session_id, prompt_id=s.prompt_id, index=int(s.session_id.rsplit("/", 1)[1]), key=s.key
                )
                for s in opened
            ]
        )

    async def RunTurn(self, request, context):
        return turn_response(await self._run_turn(request))

    async def StreamTurn(self, request, context):
        sampled: asyncio.Queue[list[int]] = asyncio.Queue()
        turn = asyncio.ensure_future(self._run_turn(request.run, sampled.put_nowait))
        try:
            while not turn.done():
                update = asyncio.ensure_future(sampled.get())
                await asyncio.wait({update, turn}, return_when=asyncio.FIRST_COMPLETED)
                if update.done():
                    yield manager_pb2.StreamTurnResponse(token_ids=update.result())
                else:
                    update.cancel()
            yield manager_pb2.StreamTurnResponse(result=turn_response(turn.result()))
        finally:
            # A caller that went away leaves the turn running: a retry of it finds it.
            if not turn.done():
                turn.cancel()

    def _run_turn(self, request: manager_pb2.RunTurnRequest, progress: Callable[[list[int]], None] | None = None):
        return self.turns.run(
            request.session_id,
            request.turn,
            [segment_from_proto(s) for s in request.append],
            request.keep_tokens if request.HasField("keep_tokens") else None,
            request.sampling if request.HasField("sampling") else None,
            conversation_from_proto(request.conversation),
            progress,
        )

    async def SetSessionReward(self, request, context):
        self.state.sessions.set_reward(
            request.session_id, request.reward, request.turn if request.HasField("turn") else None
        )
        await self.turns.flushed()
        return manager_pb2.SetSessionRewardResponse()

    async def CloseSession(self, request, context):
        session, dropped = self.state.close_session(request.session_id, request.status, request.detail)
        if dropped is not None:
            self.dispatcher.cancel([dropped])
        # One line per episode would flood an agent run's logs: the counts are in the metrics.
        log.debug(
            "session closed",
            session_id=session.session_id,
            status=manager_pb2.SessionStatus.Name(session.status),
            turns=session.turns,
            detail=session.detail or None,
        )
        await self.turns.flushed()
        self._changed()
        return manager_pb2.CloseSessionResponse(status=session.status)

    async def StartSession(self, request, context):
        session = self.state.sessions.start(request.session_id)
        await self.turns.flushed()
        return manager_pb2.StartSessionResponse(status=session.status)

    async def GetSession(self, request, context):
        session = self.state.sessions.get(request.session_id)
        return manager_pb2.GetSessionResponse(
            session=trajectory(session),
            key=session.key,
            sampling=session.sampling,
            conversation=conversation_to_proto(session.conversation),
            refuse_agent_rewards=session.limits.refuse_agent_rewards,
            refuse_breaks=session.limits.refuse_breaks,
        )

    async def WatchSessions(self, request, context):
        with self.session_feed.watch() as opened:
            while True:
                yield await opened.get()

    async def GetStatus(self, request, context):
        now = time.monotonic()
        state, request_table = self.state, self.state.request_table
        return manager_pb2.GetStatusResponse(
            instances=[instance_status(i, now) for i in state.instances.values()],
            published_version=state.published_version,
            max_staleness=state.max_staleness,
            queued_samples=len(request_table.queue),
            running_samples=state.registry.running_samples,
            ready_groups=state.delivery.ready_groups,
            delivered_groups=state.delivery.delivered_groups,
            generated_tokens=request_table.generated_tokens,
            tokens_per_second=request_table.tokens_per_second,
            requeued_samples=request_table.requeued_samples,
            discarded_tokens=request_table.discarded_tokens,
            migrated_samples=request_table.migrated_samples,
            continued_tokens=request_table.continued_tokens,
            stage_balance=balance_to_proto(state.balancer.balance),
            authorization=self.authorization,
        )

    async def collect_metrics(self, families: Families) -> None:
        """What Prometheus scrapes: the figures of GetStatus, and the staleness of the tokens held."""
        status = await self.GetStatus(manager_pb2.GetStatusRequest(), None)
        families.gauge("published_version", "Latest weight version the trainer published.", status.published_version)
        families.gauge("max_staleness", "Versions a trained token may lag the policy (eta).", status.max_staleness)
        families.gauge("queued_samples", "Samples waiting for an instance (queue depth).", status.queued_samples)
        families.gauge("running_samples", "Samples being generated.", status.running_samples)
        families.gauge("ready_groups", "Complete groups not yet streamed to the trainer.", status.ready_groups)
        families.counter("delivered_groups", "Groups streamed to the trainer.", status.delivered_groups)
        families.counter("generated_tokens", "Tokens generated across all instances.", status.generated_tokens)
        families.gauge("tokens_per_second", "Generation rate across all instances.", status.tokens_per_second)
        families.counter(
            "requeued_samples", "Samples sent back to the queue to continue elsewhere.", status.requeued_samples
        )
        families.counter(
            "migrated_samples", "Samples moved off a slow instance near the end of a step.", status.migrated_samples
        )
        families.counter(
            "continued_tokens",
            "Tokens a continuation reused instead of generating them again.",
            status.continued_tokens,
        )
        families.counter("discarded_tokens", "Tokens received from abandoned attempts.", status.discarded_tokens)
        staleness = self.state.token_staleness()
        families.gauge(
            "token_staleness_max",
            "Largest lag, in versions, of the oldest token of a sample held.",
            max(staleness, default=0),
        )
        families.gauge(
            "token_staleness_mean",
            "Mean lag, in versions, of the oldest token of the samples held.",
            sum(staleness) / len(staleness) if staleness else 0.0,
        )
        sessions = self.state.sessions
        families.gauge("open_sessions", "Multi-turn sessions open.", sessions.open_count)
        for status_value, closed in sorted(sessions.closed_by_status.items()):
            families.counter(
                "closed_sessions",
                "Multi-turn sessions closed, by status.",
                closed,
                status=manager_pb2.SessionStatus.Name(status_value).removeprefix("SESSION_STATUS_").lower(),
            )
        for cause, breaks in sorted(sessions.breaks_by_cause.items()):
            families.counter(
                "gateway_breaks",
                "Histories that did not extend their session's (each started a new part), by cause.",
                breaks,
                cause=cause,
            )
        families.gauge("instances", "Rollout instances registered.", len(status.instances))
        for instance in status.instances:
            labels = {"instance": instance.instance_id}
            families.gauge(
                "instance_weight_version", "Weight version the instance serves.", instance.weight_version, **labels
            )
            families.gauge(
                "instance_running_requests", "Requests running on the instance.", instance.running_requests, **labels
            )
            families.gauge(
                "instance_tokens_per_second",
                "The instance's measured generation rate.",
                instance.tokens_per_second,
                **labels,
            )
            families.counter(
                "instance_generated_tokens", "Tokens the instance generated.", instance.generated_tokens, **labels
            )
            families.gauge(
                "instance_quarantined",
                "1 while the instance gets no work: its requests failed one after another.",
                float(instance.quarantine_remaining_seconds > 0),
                **labels,
            )
