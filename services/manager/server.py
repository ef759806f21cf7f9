"""The ManagerService servicer and the dispatcher that runs sample requests on instances."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Coroutine
from typing import NoReturn

import grpc
import structlog

from rlmesh.common.v1 import common_pb2
from rlmesh.errors import FailedPrecondition, InvalidArgument
from rlmesh.manager.v1 import manager_pb2, manager_pb2_grpc
from rlmesh.prometheus import Families
from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlmesh.rpc import call_options, open_channel
from services.manager.config import ManagerConfig
from services.manager.instance_stream import InstanceStream
from services.manager.journal import Journal, NoJournal
from services.manager.stage_balance import Balance
from services.manager.state import Assignment, Instance, ManagerState, SampleRequest, WrongIncarnation

log = structlog.get_logger()


class Changes:
    """Wakes every waiter when the state changed; waiters re-check what they wait for."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout: float | None = None) -> None:
        event = self._event
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            pass


_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


class Dispatcher:
    """Turns assignments into requests on one GenerateMany stream per instance incarnation (one
    Generate stream per request for an instance whose contract predates GenerateMany) and feeds
    their chunks back into the state."""

    def __init__(self, state: ManagerState, changes: Changes, config: ManagerConfig) -> None:
        self.state = state
        self.changes = changes
        self.config = config
        self._channels: dict[str, tuple[grpc.aio.Channel, rollout_pb2_grpc.RolloutServiceStub]] = {}
        self._streams: dict[str, asyncio.Task[None]] = {}
        """Generate streams (one request each) by request id."""
        self._instance_streams: dict[tuple[str, int], InstanceStream] = {}
        """The stream taking new requests for each incarnation, by (instance id, incarnation)."""
        self._open_streams: dict[InstanceStream, tuple[str, int]] = {}
        """Every GenerateMany stream not ended yet (retired ones too), with its incarnation."""
        self._stream_of: dict[str, tuple[InstanceStream, str]] = {}
        """Where each request dispatched on a GenerateMany stream runs: (stream, engine request id)."""
        self._single_request_addresses: set[str] = set()
        """Instances that answered GenerateMany with UNIMPLEMENTED."""
        self._closing: set[asyncio.Task[None]] = set()

    def _stub(self, address: str) -> rollout_pb2_grpc.RolloutServiceStub:
        if address not in self._channels:
            channel = open_channel(address)
            self._channels[address] = (channel, rollout_pb2_grpc.RolloutServiceStub(channel))
        return self._channels[address][1]

    def dispatch(self) -> None:
        for assignment in self.state.assign():
            if assignment.instance.address in self._single_request_addresses:
                self._streams[assignment.request.request_id] = asyncio.create_task(self._run(assignment))
            else:
                stream = self._stream_to(assignment.instance)
                generate = self._generate_request(assignment)
                self._stream_of[assignment.request.request_id] = (stream, generate.request_id)
                stream.start(assignment, generate)

    def _stream_to(self, instance: Instance) -> InstanceStream:
        key = (instance.instance_id, instance.incarnation)
        stream = self._instance_streams.get(key)
        if stream is not None and stream.takes_requests:
            return stream
        if stream is not None:
            stream.retire()
        stream = InstanceStream(self._stub(instance.address), self.config.generate_timeout_seconds, self._received, self._stream_ended)
        self._instance_streams[key] = stream
        self._open_streams[stream] = key
        return stream

    @staticmethod
    def _generate_request(assignment: Assignment) -> rollout_pb2.GenerateRequest:
        request, instance = assignment.request, assignment.instance
        generate = rollout_pb2.GenerateRequest(
            request_id=request.engine_request_id,
            prompt_token_ids=request.prompt_token_ids,
            continued_token_ids=request.token_ids,
            sampling=request.sampling,
            incarnation_token=instance.token,
        )
        if request.exact_version:
            generate.pinned_version = request.policy_version
        generate.background = request.background
        return generate

    def _received(self, stream: InstanceStream, response: rollout_pb2.GenerateManyResponse) -> None:
        for chunk in response.chunks:
            assignment = stream.assignments.get(chunk.request_id)
            if assignment is None:
                continue
            goes_on = self._record(assignment, chunk)
            if chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                self._forget(stream, chunk.request_id)
            elif not goes_on:
                stream.cancel(chunk.request_id)
        for refusal in response.refusals:
            assignment = self._forget(stream, refusal.request_id)
            if assignment is not None:
                self._refused(assignment, _STATUS_CODES.get(refusal.code, grpc.StatusCode.UNKNOWN), refusal.message)
        self.dispatch()
        self.changes.notify()

    def _record(self, assignment: Assignment, chunk: common_pb2.TokenChunk) -> bool:
        """Feeds a chunk into the state; False when its request is not to go on (it ended, was
        taken away, or the chunk was malformed)."""
        request, instance = assignment.request, assignment.instance
        known_version = instance.weight_version
        try:
            goes_on = self.state.record_chunk(request.request_id, assignment.attempt, list(chunk.token_ids), list(chunk.logprobs),
                                              list(chunk.weight_versions), chunk.finish_reason)
        except InvalidArgument as exc:
            log.error("instance sent a malformed chunk", error=str(exc), instance_id=instance.instance_id)
            self.state.stream_lost(request.request_id, assignment.attempt)
            return False
        if instance.weight_version != known_version:
            # The instance switched: samples waiting for its new version may go now.
            self.dispatch()
            self.changes.notify()
        return goes_on

    def _forget(self, stream: InstanceStream, engine_request_id: str) -> Assignment | None:
        assignment = stream.ended(engine_request_id)
        if assignment is not None and self._stream_of.get(assignment.request.request_id, (None, ""))[1] == engine_request_id:
            del self._stream_of[assignment.request.request_id]
        return assignment

    def _stream_ended(self, stream: InstanceStream, error: grpc.aio.AioRpcError | None) -> None:
        self._discard(stream)
        for engine_request_id in list(stream.assignments):
            assignment = self._forget(stream, engine_request_id)
            if assignment is None:
                continue
            if error is not None and error.code() == grpc.StatusCode.UNIMPLEMENTED and assignment.instance.address not in self._single_request_addresses:
                log.info("instance predates GenerateMany; one Generate stream per request", instance_id=assignment.instance.instance_id)
                self._single_request_addresses.add(assignment.instance.address)
            self._refused(assignment, error.code() if error else grpc.StatusCode.INTERNAL,
                          error.details() if error else "the stream ended before the request finished")
        self.dispatch()
        self.changes.notify()

    def _discard(self, stream: InstanceStream) -> None:
        key = self._open_streams.pop(stream, None)
        if key is not None and self._instance_streams.get(key) is stream:
            del self._instance_streams[key]

    def close_streams(self, instance_id: str, keep_incarnation: int | None = None) -> None:
        """Ends the streams to the incarnations of an instance that left the pool (all but
        `keep_incarnation`); the state already requeued what they ran."""
        for stream in [s for s, (i, incarnation) in self._open_streams.items() if i == instance_id and incarnation != keep_incarnation]:
            self._discard(stream)
            for engine_request_id in list(stream.assignments):
                self._forget(stream, engine_request_id)
            stream.close()

    def _refused(self, assignment: Assignment, code: grpc.StatusCode, details: str) -> None:
        """A request ended without finishing: with `code`, as the instance refused it or its stream failed."""
        request, attempt, instance = assignment.request, assignment.attempt, assignment.instance
        if code == grpc.StatusCode.ABORTED and request.exact_version:
            if self.state.version_refused(request.request_id, attempt):
                log.info("instance moved on from an exact-version request's version", request=request.request_id,
                         instance_id=instance.instance_id, weight_version=request.policy_version, error=details)
            return
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            if self.state.reject(request.request_id, attempt, details):
                log.warning("instance refused a request; its batch fails", request=request.request_id, error=details)
            return
        if self.state.stream_lost(request.request_id, attempt):
            log.warning("stream failed; request continues elsewhere", request=request.request_id,
                        instance_id=instance.instance_id, code=code.name, tokens_kept=len(request.token_ids))
        if code == grpc.StatusCode.UNAVAILABLE:
            self._drop_gone(instance, "instance unreachable; dropped")
        elif code == grpc.StatusCode.PERMISSION_DENIED:
            self._drop_gone(instance, "another process answers at the instance's address; dropped")

    def cancel(self, requests: list[SampleRequest]) -> None:
        """Stops the requests that were taken away from their instance."""
        current = asyncio.current_task()
        for request in requests:
            if request.instance_id is not None:
                continue
            task = self._streams.get(request.request_id)
            if task is not None and task is not current:
                task.cancel()
            if request.request_id in self._stream_of:
                stream, engine_request_id = self._stream_of[request.request_id]
                stream.cancel(engine_request_id)

    async def forget_address(self, address: str) -> None:
        """Closes the channel to an address no registered instance uses any more."""
        if address in self._channels and not any(i.address == address for i in self.state.instances.values()):
            channel, _ = self._channels.pop(address)
            await channel.close()

    def migrate(self) -> None:
        """Aborts planned stragglers on their instances; each continues where it was sent."""
        for request in self.state.plan_migrations():
            instance = self.state.instances[request.instance_id or ""]
            self._in_background(self._abort_for_migration(request, instance.address, request.engine_request_id))

    def _in_background(self, work: Coroutine[None, None, None]) -> None:
        """Runs `work` without waiting for it, holding a reference until it is done."""
        task = asyncio.create_task(work)
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _abort_for_migration(self, request: SampleRequest, address: str, engine_request_id: str) -> None:
        try:
            await self._stub(address).Abort(rollout_pb2.AbortRequest(request_ids=[engine_request_id]), **call_options(self.config.rpc_timeout_seconds))
            log.info("straggler moved", request=request.request_id, to=request.migrate_to)
        except grpc.aio.AioRpcError as exc:
            log.warning("straggler abort failed; it stays", request=request.request_id, code=exc.code().name)
            self.state.migration_failed(request)

    async def _run(self, assignment: Assignment) -> None:
        """One request on its own Generate stream."""
        request, attempt, instance = assignment.request, assignment.attempt, assignment.instance
        try:
            stream = self._stub(instance.address).Generate(self._generate_request(assignment), **call_options(self.config.generate_timeout_seconds))
            async for response in stream:
                if not self._record(assignment, response.chunk):
                    stream.cancel()
                    return
            if self.state.stream_lost(request.request_id, attempt):
                log.warning("stream ended before the request finished", request=request.request_id)
        except grpc.aio.AioRpcError as exc:
            self._refused(assignment, exc.code(), exc.details() or "")
        finally:
            if self._streams.get(request.request_id) is asyncio.current_task():
                del self._streams[request.request_id]
            self.dispatch()
            self.changes.notify()

    def _drop_gone(self, instance: Instance, why: str) -> None:
        """A broken connection means a crashed instance, and a process refusing the incarnation's
        token a restarted one: drop that incarnation now rather than dispatching to it until its
        lease runs out. If it is alive, its next heartbeat registers it again."""
        if self.state.instances.get(instance.instance_id) is not instance:
            return
        requeued = self.state.remove(instance.instance_id, time.monotonic())
        self.cancel(requeued)
        self.close_streams(instance.instance_id)
        self._in_background(self.forget_address(instance.address))
        log.warning(why, instance_id=instance.instance_id, incarnation=instance.incarnation, requeued=len(requeued))

    async def close(self) -> None:
        for task in list(self._streams.values()):
            task.cancel()
        for stream in list(self._open_streams):
            stream.close()
        for channel, _ in self._channels.values():
            await channel.close()


def instance_status(instance: Instance, now: float) -> manager_pb2.InstanceStatus:
    return manager_pb2.InstanceStatus(
        instance_id=instance.instance_id,
        address=instance.address,
        weight_version=instance.weight_version,
        running_requests=len(instance.running),
        outstanding_tokens=round(instance.outstanding_tokens),
        tokens_per_second=instance.tokens_per_second,
        lease_remaining_seconds=max(0.0, instance.lease_expires - now),
        schedulable=instance.schedulable,
        generated_tokens=instance.generated_tokens,
        incarnation=instance.incarnation,
        preemptible=instance.preemptible,
        draining=instance.draining,
    )


def balance_to_proto(balance: Balance) -> manager_pb2.StageBalance:
    return manager_pb2.StageBalance(
        observed_steps=balance.observed_steps,
        train_seconds=balance.train_seconds,
        rollout_seconds=balance.rollout_seconds,
        trainer_wait_seconds=balance.trainer_wait_seconds,
        rollout_idle_seconds=balance.rollout_idle_seconds,
        local_window_seconds=balance.local_window_seconds,
        recommended_rollout_instances=balance.recommended_rollout_instances,
        offload_fraction=balance.offload_fraction,
    )


def group_to_proto(group: list[SampleRequest]) -> manager_pb2.Group:
    return manager_pb2.Group(
        prompt_id=group[0].prompt_id,
        prompt_token_ids=group[0].prompt_token_ids,
        samples=[
            manager_pb2.Sample(
                token_ids=r.token_ids,
                logprobs=r.logprobs,
                weight_versions=r.weight_versions,
                finish_reason=r.finish_reason,
                instance_ids=r.instance_ids,
            )
            for r in group
        ],
    )


async def refuse_incarnation(context: grpc.aio.ServicerContext, exc: WrongIncarnation) -> NoReturn:
    log.warning("call from another incarnation refused", error=str(exc))
    await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))


class ManagerServicer(manager_pb2_grpc.ManagerServiceServicer):
    def __init__(self, state: ManagerState, dispatcher: Dispatcher, changes: Changes, config: ManagerConfig,
                 journal: Journal | NoJournal) -> None:
        self.state = state
        self.dispatcher = dispatcher
        self.changes = changes
        self.config = config
        self.journal = journal

    def _changed(self) -> None:
        self.dispatcher.dispatch()
        self.changes.notify()

    def _durable(self) -> None:
        """What the reply about to go out confirms is in the journal first."""
        self.journal.flush(self.state)

    async def RegisterInstance(self, request, context):
        instance, requeued = self.state.register(
            request.instance_id, request.address, request.weight_version, request.max_batch_size, time.monotonic(),
            request.preemptible, request.incarnation_token,
        )
        self.dispatcher.cancel(requeued)
        self.dispatcher.close_streams(instance.instance_id, keep_incarnation=instance.incarnation)
        log.info("instance registered", instance_id=request.instance_id, address=request.address, incarnation=instance.incarnation,
                 weight_version=request.weight_version, preemptible=request.preemptible)
        self._durable()
        self._changed()
        return manager_pb2.RegisterInstanceResponse(
            lease_seconds=self.config.lease_seconds, heartbeat_interval_seconds=self.config.heartbeat_interval_seconds,
            incarnation_token=instance.token,
        )

    async def Heartbeat(self, request, context):
        before = self.state.instances.get(request.instance_id)
        version_before = before.weight_version if before else None
        draining_before = before.draining if before else False
        try:
            self.state.heartbeat(request.instance_id, request.weight_version, time.monotonic(), request.draining,
                                 token=request.incarnation_token)
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
        log.info("instance deregistered", instance_id=request.instance_id, incarnation=instance.incarnation, requeued=len(requeued))
        self._durable()
        self._changed()
        return manager_pb2.DeregisterInstanceResponse(requeued_requests=len(requeued))

    async def ListInstances(self, request, context):
        now = time.monotonic()
        return manager_pb2.ListInstancesResponse(instances=[instance_status(i, now) for i in self.state.instances.values()])

    async def PublishVersion(self, request, context):
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
            [(p.prompt_id, list(p.token_ids), p.n, p.sampling if p.HasField("sampling") else None) for p in request.prompts],
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
            taken = self.state.take_micro_batch(request.batch_id, request.micro_batch_groups, request.min_groups,
                                                request.max_tokens, position=position)
            if taken is None:
                self._check_starvation(request.batch_id)
                await self.changes.wait(timeout=1.0)
                continue
            groups, remaining = taken
            self._durable()
            # A reply the reader never gets is sent again when it resumes from its count of groups read.
            yield manager_pb2.StreamRolloutsResponse(groups=[group_to_proto(g) for g in groups], remaining_groups=remaining,
                                                     first_group_index=position)
            position += len(groups)
            if remaining == 0:
                return

    async def CancelBatch(self, request, context):
        cancelled = self.state.cancel_batch(request.batch_id)
        self._durable()
        log.info("batch cancelled", batch_id=request.batch_id, unfinished_samples=cancelled)
        self._changed()
        return manager_pb2.CancelBatchResponse(unfinished_samples=cancelled)

    async def TakeReadyGroups(self, request, context):
        groups, remaining = self.state.take_ready(request.batch_id, position=request.resume_from)
        self._durable()
        return manager_pb2.TakeReadyGroupsResponse(groups=[group_to_proto(g) for g in groups], remaining_groups=remaining,
                                                   first_group_index=request.resume_from)

    async def AcknowledgeRollouts(self, request, context):
        forgotten = self.state.acknowledge(request.batch_id)
        return manager_pb2.AcknowledgeRolloutsResponse(forgotten=forgotten)

    async def ReportTrainingStep(self, request, context):
        balance = self.state.report_training_step(request.batch_id, request.step_seconds, request.wait_seconds)
        log.info("stage balance", batch_id=request.batch_id, recommended_rollout_instances=balance.recommended_rollout_instances,
                 offload_fraction=round(balance.offload_fraction, 3), local_window_seconds=round(balance.local_window_seconds, 3))
        return manager_pb2.ReportTrainingStepResponse(stage_balance=balance_to_proto(balance))

    async def GetStatus(self, request, context):
        now = time.monotonic()
        state = self.state
        return manager_pb2.GetStatusResponse(
            instances=[instance_status(i, now) for i in state.instances.values()],
            published_version=state.published_version,
            max_staleness=state.max_staleness,
            queued_samples=len(state.queue),
            running_samples=state.running_samples,
            ready_groups=state.ready_groups,
            delivered_groups=state.delivered_groups,
            generated_tokens=state.generated_tokens,
            tokens_per_second=state.tokens_per_second,
            requeued_samples=state.requeued_samples,
            discarded_tokens=state.discarded_tokens,
            migrated_samples=state.migrated_samples,
            continued_tokens=state.continued_tokens,
            stage_balance=balance_to_proto(state.balancer.balance),
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
        families.counter("requeued_samples", "Samples sent back to the queue to continue elsewhere.", status.requeued_samples)
        families.counter("migrated_samples", "Samples moved off a slow instance near the end of a step.", status.migrated_samples)
        families.counter("continued_tokens", "Tokens a continuation reused instead of generating them again.", status.continued_tokens)
        families.counter("discarded_tokens", "Tokens received from abandoned attempts.", status.discarded_tokens)
        staleness = self.state.token_staleness()
        families.gauge("token_staleness_max", "Largest lag, in versions, of the oldest token of a sample held.", max(staleness, default=0))
        families.gauge("token_staleness_mean", "Mean lag, in versions, of the oldest token of the samples held.",
                       sum(staleness) / len(staleness) if staleness else 0.0)
        families.gauge("instances", "Rollout instances registered.", len(status.instances))
        for instance in status.instances:
            labels = {"instance": instance.instance_id}
            families.gauge("instance_weight_version", "Weight version the instance serves.", instance.weight_version, **labels)
            families.gauge("instance_running_requests", "Requests running on the instance.", instance.running_requests, **labels)
            families.gauge("instance_tokens_per_second", "The instance's measured generation rate.", instance.tokens_per_second, **labels)
            families.counter("instance_generated_tokens", "Tokens the instance generated.", instance.generated_tokens, **labels)


async def watch_leases(state: ManagerState, dispatcher: Dispatcher, changes: Changes, period: float = 0.25) -> None:
    """Drops instances whose lease expired, keeps throughput figures current, moves stragglers,
    and wakes rollout streams so they notice when no instance is left."""
    while True:
        await asyncio.sleep(period)
        now = time.monotonic()
        try:
            state.measure(now)
            dispatcher.migrate()
            if state.starved_seconds(now):
                changes.notify()
            for instance, requeued in state.expire(now):
                log.warning("lease expired; instance dropped", instance_id=instance.instance_id, requeued=len(requeued))
                dispatcher.cancel(requeued)
                dispatcher.close_streams(instance.instance_id)
                await dispatcher.forget_address(instance.address)
                dispatcher.dispatch()
                changes.notify()
        except Exception:
            # This loop is what notices dead instances: it must outlive any single failure.
            log.exception("lease check failed")
