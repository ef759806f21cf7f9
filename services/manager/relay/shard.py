"""A relay shard at work: one GenerateMany stream per instance incarnation it runs requests on, their
chunks into the payload store, and the store's progress out to whoever watches (the manager)."""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass

import grpc
import structlog

from rlmesh.manager.v1 import relay_pb2
from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlmesh.rpc.channels import open_channel
from services.manager.instance_stream import InstanceStream
from services.manager.relay.config import RelayConfig
from services.manager.relay.payload_journal import PayloadJournal
from services.manager.relay.payloads import PayloadMissing, PayloadStore

log = structlog.get_logger()


@dataclass(frozen=True, slots=True)
class Attempt:
    request_id: str
    attempt: int

    @property
    def engine_request_id(self) -> str:
        return f"{self.request_id}@{self.attempt}"


class Watcher:
    """One WatchRelay stream's view: the shard's reports queue here until the stream sends them."""

    def __init__(self) -> None:
        self.reports: dict[str, relay_pb2.RelayProgress] = {}
        self.wake = asyncio.Event()

    def add(self, reports: list[relay_pb2.RelayProgress]) -> None:
        for report in reports:
            self.reports[report.request_id] = report
        if reports:
            self.wake.set()

    def take(self) -> list[relay_pb2.RelayProgress]:
        reports, self.reports = list(self.reports.values()), {}
        self.wake.clear()
        return reports


class RelayShard:
    def __init__(self, config: RelayConfig) -> None:
        self.config = config
        self.journal = PayloadJournal(config.journal_path) if config.journal_path else None
        self.incarnation = self.journal.incarnation if self.journal is not None else secrets.token_hex(8)
        self.store = PayloadStore(self.journal, self.journal.payloads if self.journal is not None else None)
        self.watchers: set[Watcher] = set()
        self._channels: dict[str, tuple[grpc.aio.Channel, rollout_pb2_grpc.RolloutServiceStub]] = {}
        self._streams: dict[tuple[str, int], InstanceStream[Attempt]] = {}
        """The stream taking new requests for each incarnation, by (instance id, incarnation)."""
        self._open: dict[InstanceStream[Attempt], tuple[str, int]] = {}
        self._running: dict[str, tuple[str, InstanceStream[Attempt]]] = {}
        """Each request's attempt still running on an instance: its engine request id and stream."""
        self._urgent = asyncio.Event()
        self._reporter = asyncio.create_task(self._report())

    def relay(self, request: relay_pb2.RelayRequest) -> None:
        for close in request.closes:
            self._close(close.instance_id, close.keep_incarnation)
        for start in request.starts:
            self._start(start)
        for engine_request_id in request.cancel_request_ids:
            running = self._running.get(engine_request_id.rpartition("@")[0])
            if running is not None and running[0] == engine_request_id:
                running[1].cancel(engine_request_id)
        self.store.release(list(request.release_request_ids))
        self._changed()

    def _start(self, start: relay_pb2.RelayStart) -> None:
        attempt = Attempt(start.request_id, start.attempt)
        superseded = self._running.get(start.request_id)
        if superseded is not None:
            # The manager moved on from that attempt (it restarted, or lost a reply): stop it here.
            superseded[1].cancel(superseded[0])
        try:
            continued = self.store.start(
                start.request_id, start.attempt, start.continue_from, start.generate.sampling.max_tokens
            )
        except PayloadMissing as exc:
            self.store.payloads.pop(start.request_id, None)
            self.store.start(start.request_id, start.attempt, 0, start.generate.sampling.max_tokens)
            self.store.end(start.request_id, start.attempt, 0, grpc.StatusCode.NOT_FOUND.value[0], str(exc))
            return
        if continued is None:
            return
        generate = rollout_pb2.GenerateRequest()
        generate.CopyFrom(start.generate)
        generate.request_id = attempt.engine_request_id
        generate.continued_token_ids[:] = continued
        stream = self._stream_to(start.instance_id, start.incarnation, start.address)
        self._running[start.request_id] = (attempt.engine_request_id, stream)
        stream.start(attempt, generate)

    def _stub(self, address: str) -> rollout_pb2_grpc.RolloutServiceStub:
        if address not in self._channels:
            channel = open_channel(address)
            self._channels[address] = (channel, rollout_pb2_grpc.RolloutServiceStub(channel))
        return self._channels[address][1]

    def _stream_to(self, instance_id: str, incarnation: int, address: str) -> InstanceStream[Attempt]:
        key = (instance_id, incarnation)
        stream = self._streams.get(key)
        if stream is not None and stream.takes_requests:
            return stream
        if stream is not None:
            stream.retire()
        stream = InstanceStream(
            self._stub(address), self.config.generate_timeout_seconds, self._received, self._stream_ended
        )
        self._streams[key] = stream
        self._open[stream] = key
        return stream

    def _received(self, stream: InstanceStream[Attempt], response: rollout_pb2.GenerateManyResponse) -> None:
        for chunk in response.chunks:
            attempt = stream.assignments.get(chunk.request_id)
            if attempt is None:
                continue
            goes_on = self.store.record(attempt.request_id, attempt.attempt, chunk)
            if chunk.finish_reason:
                self._ended(stream, chunk.request_id)
            elif not goes_on:
                stream.cancel(chunk.request_id)
        for refusal in response.refusals:
            attempt = self._ended(stream, refusal.request_id)
            if attempt is not None:
                self.store.end(attempt.request_id, attempt.attempt, 0, refusal.code, refusal.message)
        self._changed()

    def _ended(self, stream: InstanceStream[Attempt], engine_request_id: str) -> Attempt | None:
        request_id = engine_request_id.rpartition("@")[0]
        if self._running.get(request_id) == (engine_request_id, stream):
            del self._running[request_id]
        return stream.ended(engine_request_id)

    def _stream_ended(self, stream: InstanceStream[Attempt], error: grpc.aio.AioRpcError | None) -> None:
        key = self._open.pop(stream, None)
        if key is not None and self._streams.get(key) is stream:
            del self._streams[key]
        code = error.code() if error is not None else grpc.StatusCode.CANCELLED
        details = (error.details() or "") if error is not None else "the stream ended before the request finished"
        for engine_request_id in list(stream.assignments):
            attempt = self._ended(stream, engine_request_id)
            if attempt is not None:
                self.store.end(attempt.request_id, attempt.attempt, 0, code.value[0], details)
        self._changed()

    def _close(self, instance_id: str, keep_incarnation: int) -> None:
        for stream, (owner, incarnation) in list(self._open.items()):
            if owner == instance_id and incarnation != keep_incarnation:
                self._stream_ended(stream, None)
                stream.close()

    def _changed(self) -> None:
        if self.store.has_urgent:
            self._urgent.set()

    async def _report(self) -> None:
        """Finished and ended attempts go out within the report window; running ones' counts once
        a progress period."""
        loop = asyncio.get_running_loop()
        next_progress = loop.time() + self.config.progress_seconds
        while True:
            running_too = False
            try:
                await asyncio.wait_for(self._urgent.wait(), max(0.0, next_progress - loop.time()))
                await asyncio.sleep(self.config.report_window_seconds)
            except TimeoutError:
                next_progress = loop.time() + self.config.progress_seconds
                running_too = True
            self._urgent.clear()
            reports = self.store.take_reports(running_too)
            for watcher in self.watchers:
                watcher.add(reports)

    def watch(self) -> Watcher:
        watcher = Watcher()
        watcher.add(self.store.snapshot())
        watcher.wake.set()
        self.watchers.add(watcher)
        return watcher

    async def close(self) -> None:
        self._reporter.cancel()
        for stream in list(self._open):
            stream.close()
        for channel, _ in self._channels.values():
            await channel.close()
        if self.journal is not None:
            self.journal.close()
