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
    """One shard: commands go out in order, one Relay call at a time; progress comes back on a
    WatchRelay stream opened again whenever it ends."""

    def __init__(self, address: str, relays: Relays) -> None:
        self.address = address
        self.relays = relays
        self.incarnation = ""
        self.running: dict[str, Assignment] = {}
        """Attempts the shard runs, by the manager's request id."""
        self._counted_at_start: dict[str, int] = {}
        """The ledger's count when each attempt started, until its first report says what it continued after."""
        self._channel = open_channel(address)
        self._stub = relay_pb2_grpc.RelayServiceStub(self._channel)
        self._outgoing = relay_pb2.RelayRequest()
        self._starts: list[Assignment] = []
        self._wake = asyncio.Event()
        self._sender = asyncio.create_task(self._send())
        self._watcher = asyncio.create_task(self._watch())

    def start(self, assignment: Assignment, generate: rollout_pb2.GenerateRequest) -> None:
        request, instance = assignment.request, assignment.instance
        self.running[request.request_id] = assignment
        self._counted_at_start[request.request_id] = request.relayed_tokens
        self._starts.append(assignment)
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
        while True:
            await self._wake.wait()
            self._wake.clear()
            message, self._outgoing = self._outgoing, relay_pb2.RelayRequest()
            starts, self._starts = self._starts, []
            try:
                await self._stub.Relay(message, **call_options(self.relays.rpc_timeout_seconds))
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    "relay shard unreachable; its requests continue elsewhere", relay=self.address, code=exc.code().name
                )
                # Releases and closes are kept for the next call; starts the shard may not have
                # taken continue elsewhere (a later attempt supersedes one it did take).
                kept = relay_pb2.RelayRequest(release_request_ids=message.release_request_ids, closes=message.closes)
                kept.MergeFrom(self._outgoing)
                self._outgoing = kept
                self.relays.lost([a for a in starts if self.running.get(a.request.request_id) is a], self)
                await asyncio.sleep(RETRY_SECONDS)
                if self._outgoing.release_request_ids or self._outgoing.closes:
                    self._wake.set()

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

    def runs(self, request_id: str) -> bool:
        return any(request_id in link.running for link in self.links.values())

    async def close(self) -> None:
        for link in self.links.values():
            await link.close()
