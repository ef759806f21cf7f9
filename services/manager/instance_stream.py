"""One GenerateMany stream from the manager to one incarnation of a rollout instance: the requests
dispatched to it go out batched, and the chunks and refusals that come back are handed to the
dispatcher, which owns what they mean."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Generic, TypeVar

import grpc

from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlmesh.rpc.channels import call_options

Ticket = TypeVar("Ticket")
"""What the caller keeps per request (the manager's assignment, a relay shard's attempt)."""

TAKES_REQUESTS_FOR = 0.5
"""Share of its deadline during which a stream takes new requests; then the dispatcher opens
another and this one only finishes what it runs, so a request has at least that long before its
stream's deadline cuts it (it then continues elsewhere from its tokens)."""


class InstanceStream(Generic[Ticket]):
    """Requests are keyed by their engine request id (one per attempt), and stay here until a chunk
    that finishes them, a refusal, or the end of the stream: a request cancelled here still
    delivers its last (ABORT) chunk, whose tokens the state counts as discarded."""

    def __init__(
        self,
        stub: rollout_pb2_grpc.RolloutServiceStub,
        timeout_seconds: float,
        on_response: Callable[[InstanceStream[Ticket], rollout_pb2.GenerateManyResponse], None],
        on_end: Callable[[InstanceStream[Ticket], grpc.aio.AioRpcError | None], None],
    ) -> None:
        self.assignments: dict[str, Ticket] = {}
        self.retire_at = time.monotonic() + timeout_seconds * TAKES_REQUESTS_FOR
        self._call = stub.GenerateMany(**call_options(timeout_seconds))
        self._outgoing = rollout_pb2.GenerateManyRequest()
        self._cancelled: set[str] = set()
        self._retired = False
        self._wake = asyncio.Event()
        self._on_response = on_response
        self._on_end = on_end
        self._sender = asyncio.create_task(self._send())
        self._receiver = asyncio.create_task(self._receive())

    @property
    def takes_requests(self) -> bool:
        return not self._retired and time.monotonic() < self.retire_at

    def start(self, assignment: Ticket, generate: rollout_pb2.GenerateRequest) -> None:
        self.assignments[generate.request_id] = assignment
        self._outgoing.requests.append(generate)
        self._wake.set()

    def cancel(self, engine_request_id: str) -> None:
        """Asks the instance to abort a request; it stays until its last chunk arrives."""
        if engine_request_id in self.assignments and engine_request_id not in self._cancelled:
            self._cancelled.add(engine_request_id)
            self._outgoing.cancel_request_ids.append(engine_request_id)
            self._wake.set()

    def ended(self, engine_request_id: str) -> Ticket | None:
        """A request's last chunk or its refusal arrived: forget it."""
        self._cancelled.discard(engine_request_id)
        assignment = self.assignments.pop(engine_request_id, None)
        if self._retired and not self.assignments:
            self._wake.set()
        return assignment

    def retire(self) -> None:
        """No new requests: the stream closes once the ones it runs have ended."""
        self._retired = True
        self._wake.set()

    def close(self) -> None:
        """Ends the stream now; what it still ran is the caller's to requeue."""
        self._call.cancel()
        self._sender.cancel()
        self._receiver.cancel()

    async def _send(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            message, self._outgoing = self._outgoing, rollout_pb2.GenerateManyRequest()
            try:
                if message.requests or message.cancel_request_ids:
                    await self._call.write(message)
                if self._retired and not self.assignments:
                    await self._call.done_writing()
                    return
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                return  # the stream failed: the receiver reports it

    async def _receive(self) -> None:
        error = None
        try:
            async for response in self._call:
                self._on_response(self, response)
        except grpc.aio.AioRpcError as exc:
            error = exc
        self._sender.cancel()
        self._on_end(self, error)
