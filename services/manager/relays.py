"""The manager's side of its relay shards: hands each a request's attempts (the same shard for every
attempt, by its group), and turns the shards' cumulative progress into the ledger's counts."""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable

import grpc
import structlog

from rlmesh.common.v1 import common_pb2
from rlmesh.manager.v1 import relay_pb2, relay_pb2_grpc
from rlmesh.rollout.v1 import rollout_pb2
from rlmesh.rpc.channels import call_options, open_channel
from services.manager.domain.records import Assignment, SampleRequest
from services.manager.domain.state import ManagerState

log = structlog.get_logger()

Ended = Callable[[Assignment, grpc.StatusCode, str], None]
"""What the dispatcher does with an attempt that ended without finishing (its refusal rules)."""

_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}
RETRY_SECONDS = 0.5


def relay_of(request: SampleRequest, addresses: list[str]) -> str:
    """The shard a request's group goes to: every sample of a group on one, fetched in one call."""
    return addresses[zlib.crc32(f"{request.batch_id}/{request.prompt_id}".encode()) % len(addresses)]


class ShardLink:
    """One shard: commands go out in order on one Relay stream (the next opens once half its
    deadline passed, after the last one's messages were all taken); progress comes back on a
    WatchRelay stream opened again whenever it ends. A broken Relay stream may have lost what was
    in flight: every attempt no report has named yet runs again (a newer attempt supersedes an
    older one at the shard), and the stream's releases and closes are sent again."""

    def __init__(self, address: str, relays: Relays) -> None:
        self.address = address
        self.relays = relays
        self.incarnation = ""
        self.running: dict[str, Assignment] = {}
        """Attempts the shard runs, by the manager's request id."""
        self._counted_at_start: dict[str, int] = {}
        """The ledger's count when each attempt started, until its first report says what it continued after."""
        self._unconfirmed: set[str] = set()
        """Requests whose running attempt no report has named yet."""
        self._channel = open_channel(address)
        self._stub = relay_pb2_grpc.RelayServiceStub(self._channel)
        self._outgoing = relay_pb2.RelayRequest()
        self._sent_again = relay_pb2.RelayRequest()
        """The releases and closes the current stream carried: sent again if it breaks."""
        self._call: grpc.aio.StreamUnaryCall | None = None
        self._ending: asyncio.Task[None] | None = None
        """Waits for the current stream's end (held so the task is not collected)."""
        self._wake = asyncio.Event()
        self._sender = asyncio.create_task(self._send())
        self._watcher = asyncio.create_task(self._watch())

    def start(self, assignment: Assignment, generate: rollout_pb2.GenerateRequest) -> None:
        request, instance = assignment.request, assignment.instance
        self.running[request.request_id] = assignment
        self._counted_at_start[request.request_id] = request.relayed_tokens
        self._unconfirmed.add(request.request_id)
        self._outgoing.starts.append(
            relay_pb2.RelayStart(
                request_id=request.request_id,
                attempt=assignment.attempt,
                instance_id=instance.instance_id,
                incarnation=instance.incarnation,
                address=instance.address,
                generate=generate,
                continue_from=request.relayed_tokens,
            )
        )
        self._wake.set()

    def cancel(self, engine_request_id: str) -> None:
        self._outgoing.cancel_request_ids.append(engine_request_id)
        self._wake.set()

    def release(self, request_ids: list[str]) -> None:
        self._outgoing.release_request_ids.extend(request_ids)
        self._wake.set()

    def close_instance(self, instance_id: str, keep_incarnation: int | None) -> None:
        self._outgoing.closes.append(
            relay_pb2.RelayClose(instance_id=instance_id, keep_incarnation=keep_incarnation or 0)
        )
        self._wake.set()

    async def _send(self) -> None:
        loop = asyncio.get_running_loop()
        retire_at = 0.0
        while True:
            await self._wake.wait()
            self._wake.clear()
            message, self._outgoing = self._outgoing, relay_pb2.RelayRequest()
            try:
                if self._call is not None and loop.time() > retire_at:
                    retiring, self._call = self._call, None
                    await retiring.done_writing()
                    await retiring
                if self._call is None:
                    timeout = self.relays.watch_timeout_seconds
                    self._call = self._stub.Relay(**call_options(timeout))
                    self._ending = asyncio.create_task(self._until_ended(self._call))
                    self._sent_again = relay_pb2.RelayRequest()
                    retire_at = loop.time() + timeout / 2
                await self._call.write(message)
                self._sent_again.release_request_ids.extend(message.release_request_ids)
                self._sent_again.closes.extend(message.closes)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
                self._broken(message, exc)
                await asyncio.sleep(RETRY_SECONDS)
                self._wake.set()

    async def _until_ended(self, call: grpc.aio.StreamUnaryCall) -> None:
        """A stream that ends while it is still the one written to broke (a retired one was ended here)."""
        try:
            await call
            error: Exception = asyncio.InvalidStateError("the shard ended the stream")
        except grpc.aio.AioRpcError as exc:
            error = exc
        if call is self._call:
            self._broken(relay_pb2.RelayRequest(), error)
            self._wake.set()

    def _broken(self, message: relay_pb2.RelayRequest, exc: Exception) -> None:
        code = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else "stream ended"
        log.warning("relay stream broke; attempts it may have lost run again", relay=self.address, code=code)
        if self._call is not None:
            self._call.cancel()
        self._call = None
        kept = relay_pb2.RelayRequest(
            release_request_ids=[*self._sent_again.release_request_ids, *message.release_request_ids],
            closes=[*self._sent_again.closes, *message.closes],
        )
        kept.MergeFrom(self._outgoing)
        self._outgoing = kept
        lost = [self.running[r] for r in self._unconfirmed if r in self.running]
        self._unconfirmed.clear()
        self.relays.lost(lost, self)

    async def _watch(self) -> None:
        while True:
            try:
                stream = self._stub.WatchRelay(
                    relay_pb2.WatchRelayRequest(), **call_options(self.relays.watch_timeout_seconds)
                )
                async for response in stream:
                    self._restarted(response.shard_incarnation)
                    self._progress(response.progress)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    await asyncio.sleep(RETRY_SECONDS)

    def _restarted(self, incarnation: str) -> None:
        if incarnation == self.incarnation:
            return
        if self.incarnation:
            lost = self.relays.state.relay_lost(self.address)
            self.relays.lost(list(self.running.values()), self)
            log.error(
                "relay shard restarted without its tokens; they generate again", relay=self.address, requests=len(lost)
            )
        self.incarnation = incarnation

    def _progress(self, reports: list[relay_pb2.RelayProgress]) -> None:
        state = self.relays.state
        # Only a freed slot or an instance's new version lets more work start: then dispatch.
        freed = False
        for report in reports:
            assignment = self.running.get(report.request_id)
            if assignment is None or assignment.attempt != report.attempt:
                continue
            known_version = assignment.instance.weight_version
            self._unconfirmed.discard(report.request_id)
            counted = self._counted_at_start.pop(report.request_id, report.continued_from)
            if report.continued_from > counted:
                # Tokens an earlier attempt handed back after the ledger requeued it: continued too.
                state.count_continued(report.continued_from - counted)
            goes_on = state.record_progress(
                report.request_id,
                report.attempt,
                report.token_count,
                report.first_version,
                report.last_version,
                report.finish_reason if not report.ended else common_pb2.FINISH_REASON_UNSPECIFIED,
            )
            freed = freed or assignment.instance.weight_version != known_version
            if report.ended:
                del self.running[report.request_id]
                code = _STATUS_CODES.get(report.code, grpc.StatusCode.UNKNOWN)
                if code == grpc.StatusCode.NOT_FOUND:
                    state.relay_lost(self.address)
                self.relays.ended(assignment, code, report.message)
                freed = True
            elif report.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                del self.running[report.request_id]
                freed = True
            elif not goes_on:
                self.cancel(f"{report.request_id}@{report.attempt}")
        self.relays.changed(freed)

    async def close(self) -> None:
        self._sender.cancel()
        self._watcher.cancel()
        if self._call is not None:
            self._call, call = None, self._call
            call.cancel()
        await self._channel.close()


class Relays:
    def __init__(
        self,
        addresses: list[str],
        state: ManagerState,
        ended: Ended,
        changed: Callable[[bool], None],
        rpc_timeout_seconds: float,
        watch_timeout_seconds: float,
    ) -> None:
        self.addresses = addresses
        self.state = state
        self.ended = ended
        self.changed = changed
        self.rpc_timeout_seconds = rpc_timeout_seconds
        self.watch_timeout_seconds = watch_timeout_seconds
        self.links = {address: ShardLink(address, self) for address in addresses}

    def takes(self, request: SampleRequest) -> bool:
        """Sessions' turns and exact-version work keep the manager's own streams (their tokens are
        read here), as does a request whose tokens the manager already holds."""
        return bool(self.addresses) and not (request.session_id or request.exact_version or request.token_ids)

    def start(self, assignment: Assignment, generate: rollout_pb2.GenerateRequest) -> None:
        request = assignment.request
        request.relay = request.relay or relay_of(request, self.addresses)
        self.links[request.relay].start(assignment, generate)

    def cancel(self, request: SampleRequest, engine_request_id: str) -> bool:
        """Has the request's shard abort the attempt; False when the shard does not run it."""
        link = self.links.get(request.relay)
        if link is None or link.running.get(request.request_id) is None:
            return False
        link.cancel(engine_request_id)
        return True

    def lost(self, assignments: list[Assignment], link: ShardLink) -> None:
        """Attempts the shard does not run (it was unreachable, or restarted): each continues
        elsewhere from the ledger's count; their instances are not to blame."""
        for assignment in assignments:
            link.running.pop(assignment.request.request_id, None)
            self.state.stream_lost(assignment.request.request_id, assignment.attempt)
        self.changed(True)

    def release(self, requests: list[SampleRequest]) -> None:
        by_relay: dict[str, list[str]] = {}
        for request in requests:
            if request.relay:
                by_relay.setdefault(request.relay, []).append(request.request_id)
        for address, request_ids in by_relay.items():
            if address in self.links:
                self.links[address].release(request_ids)

    def close_instance(self, instance_id: str, keep_incarnation: int | None) -> None:
        for link in self.links.values():
            link.close_instance(instance_id, keep_incarnation)

    async def close(self) -> None:
        for link in self.links.values():
            await link.close()
