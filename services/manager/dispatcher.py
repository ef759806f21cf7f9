"""The dispatcher: runs sample requests on rollout instances (one GenerateMany stream per instance
incarnation, or one Generate stream per request for an instance predating GenerateMany), feeds
their chunks back into the state, and wakes whoever waits on the state's changes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine

import grpc
import structlog

from rlmesh.common.v1 import common_pb2
from rlmesh.errors import InvalidArgument
from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlmesh.rpc.channels import call_options, open_channel
from services.manager.config import ManagerConfig
from services.manager.domain.records import Assignment, Instance, SampleRequest
from services.manager.domain.state import ManagerState
from services.manager.instance_stream import InstanceStream
from services.manager.relays import Relays

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
_FAULTS = frozenset(
    {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DATA_LOSS}
)
"""Codes of an instance that is up but cannot serve the request (a dead engine answers INTERNAL to
everything): they count towards its quarantine. A deadline (the stream's rotation), a cancel, a
lost connection, a drain or an instance predating GenerateMany (UNIMPLEMENTED) do not."""


RELAYED_DISPATCH_SECONDS = 0.05
"""Longest a slot a relay shard reported free waits for the dispatch pass that fills it."""


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
        self._instance_streams: dict[tuple[str, int], InstanceStream[Assignment]] = {}
        """The stream taking new requests for each incarnation, by (instance id, incarnation)."""
        self._open_streams: dict[InstanceStream[Assignment], tuple[str, int]] = {}
        """Every GenerateMany stream not ended yet (retired ones too), with its incarnation."""
        self._stream_of: dict[str, tuple[InstanceStream[Assignment], str]] = {}
        """Where each request dispatched on a GenerateMany stream runs: (stream, engine request id)."""
        self._single_request_addresses: set[str] = set()
        """Instances that answered GenerateMany with UNIMPLEMENTED."""
        self._closing: set[asyncio.Task[None]] = set()
        self._relayed_dispatch_due = False
        self.relays = (
            Relays(
                config.relay_addresses,
                state,
                self._refused,
                self._relayed,
                config.rpc_timeout_seconds,
                config.generate_timeout_seconds,
            )
            if config.relay_addresses
            else None
        )

    def _stub(self, address: str) -> rollout_pb2_grpc.RolloutServiceStub:
        if address not in self._channels:
            channel = open_channel(address)
            self._channels[address] = (channel, rollout_pb2_grpc.RolloutServiceStub(channel))
        return self._channels[address][1]

    def dispatch(self) -> None:
        for assignment in self.state.assign():
            if self.relays is not None and (assignment.request.relay or self.relays.takes(assignment.request)):
                self.relays.start(assignment, self._generate_request(assignment))
            elif assignment.instance.address in self._single_request_addresses:
                self._streams[assignment.request.request_id] = asyncio.create_task(self._run(assignment))
            else:
                stream = self._stream_to(assignment.instance)
                generate = self._generate_request(assignment)
                self._stream_of[assignment.request.request_id] = (stream, generate.request_id)
                stream.start(assignment, generate)

    def _stream_to(self, instance: Instance) -> InstanceStream[Assignment]:
        key = (instance.instance_id, instance.incarnation)
        stream = self._instance_streams.get(key)
        if stream is not None and stream.takes_requests:
            return stream
        if stream is not None:
            stream.retire()
        stream = InstanceStream(
            self._stub(instance.address), self.config.generate_timeout_seconds, self._received, self._stream_ended
        )
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
        # A session's turns: the instance may keep the session's KV cache from one turn to the next.
        generate.cache_key = request.session_id
        return generate

    def _received(self, stream: InstanceStream[Assignment], response: rollout_pb2.GenerateManyResponse) -> None:
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

    def _relayed(self, freed: bool) -> None:
        """A relay shard's reports changed the ledger; `freed`: a slot freed or an instance switched
        version, so more work may start: one pass then takes what every shard freed within the
        window, however many shards there are. Running counts alone complete nothing a waiter waits
        for, so they wake nobody."""
        if not freed:
            return
        if not self._relayed_dispatch_due:
            self._relayed_dispatch_due = True
            asyncio.get_running_loop().call_later(RELAYED_DISPATCH_SECONDS, self._dispatch_relayed)
        self.changes.notify()

    def _dispatch_relayed(self) -> None:
        self._relayed_dispatch_due = False
        self.dispatch()
        self.changes.notify()

    def _record(self, assignment: Assignment, chunk: common_pb2.TokenChunk) -> bool:
        """Feeds a chunk into the state; False when its request is not to go on (it ended, was
        taken away, or the chunk was malformed)."""
        request, instance = assignment.request, assignment.instance
        known_version = instance.weight_version
        try:
            goes_on = self.state.record_chunk(
                request.request_id,
                assignment.attempt,
                list(chunk.token_ids),
                list(chunk.logprobs),
                list(chunk.weight_versions),
                chunk.finish_reason,
            )
        except InvalidArgument as exc:
            log.error("instance sent a malformed chunk", error=str(exc), instance_id=instance.instance_id)
            self.state.stream_lost(request.request_id, assignment.attempt)
            return False
        if instance.weight_version != known_version:
            # The instance switched: samples waiting for its new version may go now.
            self.dispatch()
            self.changes.notify()
        return goes_on

    def _forget(self, stream: InstanceStream[Assignment], engine_request_id: str) -> Assignment | None:
        assignment = stream.ended(engine_request_id)
        if (
            assignment is not None
            and self._stream_of.get(assignment.request.request_id, (None, ""))[1] == engine_request_id
        ):
            del self._stream_of[assignment.request.request_id]
        return assignment

    def _stream_ended(self, stream: InstanceStream[Assignment], error: grpc.aio.AioRpcError | None) -> None:
        self._discard(stream)
        for engine_request_id in list(stream.assignments):
            assignment = self._forget(stream, engine_request_id)
            if assignment is None:
                continue
            if (
                error is not None
                and error.code() == grpc.StatusCode.UNIMPLEMENTED
                and assignment.instance.address not in self._single_request_addresses
            ):
                log.info(
                    "instance predates GenerateMany; one Generate stream per request",
                    instance_id=assignment.instance.instance_id,
                )
                self._single_request_addresses.add(assignment.instance.address)
            self._refused(
                assignment,
                error.code() if error else grpc.StatusCode.CANCELLED,
                error.details() if error else "the stream ended before the request finished",
            )
        self.dispatch()
        self.changes.notify()

    def _discard(self, stream: InstanceStream[Assignment]) -> None:
        key = self._open_streams.pop(stream, None)
        if key is not None and self._instance_streams.get(key) is stream:
            del self._instance_streams[key]

    def close_streams(self, instance_id: str, keep_incarnation: int | None = None) -> None:
        """Ends the streams to the incarnations of an instance that left the pool (all but
        `keep_incarnation`); the state already requeued what they ran."""
        for stream in [
            s
            for s, (i, incarnation) in self._open_streams.items()
            if i == instance_id and incarnation != keep_incarnation
        ]:
            self._discard(stream)
            for engine_request_id in list(stream.assignments):
                self._forget(stream, engine_request_id)
            stream.close()
        if self.relays is not None:
            self.relays.close_instance(instance_id, keep_incarnation)

    def _refused(self, assignment: Assignment, code: grpc.StatusCode, details: str) -> None:
        """A request ended without finishing: with `code`, as the instance refused it or its stream failed."""
        request, attempt, instance = assignment.request, assignment.attempt, assignment.instance
        if code == grpc.StatusCode.ABORTED and request.exact_version:
            if self.state.version_refused(request.request_id, attempt):
                log.info(
                    "instance moved on from an exact-version request's version",
                    request=request.request_id,
                    instance_id=instance.instance_id,
                    weight_version=request.policy_version,
                    error=details,
                )
            return
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            if self.state.reject(request.request_id, attempt, details):
                log.warning(
                    "instance refused a session's turn; the session ends"
                    if request.session_id
                    else "instance refused a request; its batch fails",
                    request=request.request_id,
                    error=details,
                )
            return
        if code in _FAULTS:
            self._failed(assignment, code, details)
            return
        if self.state.stream_lost(request.request_id, attempt):
            log.warning(
                "stream failed; request continues elsewhere",
                request=request.request_id,
                instance_id=instance.instance_id,
                code=code.name,
                tokens_kept=request.token_count,
            )
        if code == grpc.StatusCode.UNAVAILABLE:
            self._drop_gone(instance, "instance unreachable; dropped")
        elif code == grpc.StatusCode.PERMISSION_DENIED:
            self._drop_gone(instance, "another process answers at the instance's address; dropped")

    def _failed(self, assignment: Assignment, code: grpc.StatusCode, details: str) -> None:
        """The instance failed the request (it is up, but something in it is broken)."""
        request, instance = assignment.request, assignment.instance
        failure = self.state.request_failed(request.request_id, assignment.attempt, f"{code.name}: {details}")
        if failure is None:
            return
        if failure.batch_failed:
            log.error(
                "a sample failed on attempt after attempt; its batch fails",
                request=request.request_id,
                instance_id=instance.instance_id,
                code=code.name,
                error=details,
            )
        else:
            log.warning(
                "request failed; it continues elsewhere",
                request=request.request_id,
                instance_id=instance.instance_id,
                code=code.name,
                error=details,
                tokens_kept=request.token_count,
            )
        if failure.quarantine_seconds:
            log.error(
                "instance quarantined: its requests fail one after another",
                instance_id=instance.instance_id,
                seconds=failure.quarantine_seconds,
                quarantines=instance.quarantines,
                code=code.name,
                error=details,
            )

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
            if request.relay and self.relays is not None:
                self.relays.cancel(request, request.engine_request_id)

    async def forget_address(self, address: str) -> None:
        """Closes the channel to an address no registered instance uses any more."""
        if address in self._channels and not any(i.address == address for i in self.state.instances.values()):
            channel, _ = self._channels.pop(address)
            await channel.close()

    def migrate(self) -> None:
        """Aborts planned stragglers on their instances; each continues where it was sent. A relayed
        one is aborted by its relay shard, on the stream it runs on."""
        for request in self.state.plan_migrations():
            if request.relay and self.relays is not None:
                if not self.relays.cancel(request, request.engine_request_id):
                    self.state.migration_failed(request)
                continue
            instance = self.state.instances[request.instance_id or ""]
            self._in_background(self._abort_for_migration(request, instance.address, request.engine_request_id))

    def _in_background(self, work: Coroutine[None, None, None]) -> None:
        """Runs `work` without waiting for it, holding a reference until it is done."""
        task = asyncio.create_task(work)
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _abort_for_migration(self, request: SampleRequest, address: str, engine_request_id: str) -> None:
        try:
            await self._stub(address).Abort(
                rollout_pb2.AbortRequest(request_ids=[engine_request_id]),
                **call_options(self.config.rpc_timeout_seconds),
            )
            log.info("straggler moved", request=request.request_id, to=request.migrate_to)
        except grpc.aio.AioRpcError as exc:
            log.warning("straggler abort failed; it stays", request=request.request_id, code=exc.code().name)
            self.state.migration_failed(request)

    async def _run(self, assignment: Assignment) -> None:
        """One request on its own Generate stream."""
        request, attempt, instance = assignment.request, assignment.attempt, assignment.instance
        try:
            stream = self._stub(instance.address).Generate(
                self._generate_request(assignment), **call_options(self.config.generate_timeout_seconds)
            )
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

    def release(self, requests: list[SampleRequest]) -> None:
        """Their batch was read or cancelled: the relay shards holding their tokens may drop them."""
        if self.relays is not None:
            self.relays.release(requests)

    async def close(self) -> None:
        if self.relays is not None:
            await self.relays.close()
        for task in list(self._streams.values()):
            task.cancel()
        for stream in list(self._open_streams):
            stream.close()
        for channel, _ in self._channels.values():
            await channel.close()
