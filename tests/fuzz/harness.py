"""Every service started for real in-process on loopback, every RPC called through stubs built from
its descriptor, and every answer classified: answered, a crash, a hang, a legitimate wait."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlmesh.manager.v1 import manager_pb2, relay_pb2
from rlmesh.rollout.v1 import rollout_pb2
from rlmesh.rpc.channels import channel_options
from rlmesh.rpc.credentials import peer_secrets
from rlmesh.rpc.servers import GrpcServer
from rlmesh.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from rlmesh.weights.v1 import weights_pb2
from services.trainer.loop import TrainingStatus
from services.trainer.server import TrainerServicer
from tests.support.credentials import TEST_SECRETS, loopback
from tests.support.meshes import Mesh, build_mesh, stop_mesh

CONTRACTS = {
    "manager": manager_pb2,
    "relay": relay_pb2,
    "rollout": rollout_pb2,
    "weights": weights_pb2,
    "trainer": trainer_pb2,
}

CALL_TIMEOUT = 5.0
"""Deadline of a call that must be answered at once: running into it is a hang."""
WAIT_TIMEOUT = 0.3
"""Deadline of a call that legitimately waits (a rollout stream of a batch still generating)."""

CRASH_CODES = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DATA_LOSS}
"""What grpc answers when a servicer raised an exception it did not map to a status."""
UNANSWERED_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}


@dataclass(frozen=True, slots=True)
class Rpc:
    service: str
    name: str
    path: str
    request: type[Message]
    response: type[Message]
    client_streaming: bool
    server_streaming: bool

    @property
    def key(self) -> str:
        return f"{self.service}.{self.name}"


def contract_rpcs() -> list[Rpc]:
    """Every RPC of the mesh's services (the manager's relay shard among them), read from the contracts."""
    rpcs = []
    for short, module in CONTRACTS.items():
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                rpcs.append(
                    Rpc(
                        short,
                        method.name,
                        f"/{service.full_name}/{method.name}",
                        message_factory.GetMessageClass(method.input_type),
                        message_factory.GetMessageClass(method.output_type),
                        method.client_streaming,
                        method.server_streaming,
                    )
                )
    return rpcs


@dataclass(frozen=True, slots=True)
class Wire:
    """A request as sent: a message, optionally followed by fields its contract does not know
    (what a peer on a newer contract sends), or raw bytes."""

    message: Message | None = None
    unknown: bytes = b""
    raw: bytes | None = None

    def encode(self) -> bytes:
        if self.raw is not None:
            return self.raw
        assert self.message is not None
        return self.message.SerializeToString() + self.unknown


@dataclass(slots=True)
class Outcome:
    rpc: str
    code: grpc.StatusCode
    details: str
    seconds: float
    responses: int
    may_wait: bool

    @property
    def verdict(self) -> str:
        if self.details.startswith("Sent message larger than max"):
            # The client refused to send it: a generated request over the client's own limit.
            return "unsent"
        if self.code in CRASH_CODES:
            return "crash"
        if self.code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return "waited" if self.may_wait else "hang"
        if self.code in UNANSWERED_CODES or self.details.startswith("Stream removed"):
            # "Stream removed": the answer's trailers were over the client's limit, so it was lost.
            return "unanswered"
        if self.code != grpc.StatusCode.OK and not self.details.strip():
            return "silent"
        return "answered"

    @property
    def ok(self) -> bool:
        return self.verdict in ("answered", "waited")


@dataclass
class Stats:
    """Requests per RPC with the statuses and verdicts seen; setup calls are counted apart."""

    started: float = field(default_factory=time.monotonic)
    statuses: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    verdicts: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    setup_calls: int = 0

    def record(self, outcome: Outcome) -> None:
        self.statuses[outcome.rpc][outcome.code.name] += 1
        self.verdicts[outcome.rpc][outcome.verdict] += 1

    def total(self, verdict: str | None = None) -> int:
        return sum(c[verdict] if verdict else sum(c.values()) for c in self.verdicts.values())

    def report(self) -> dict[str, Any]:
        return {
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),  # the day docs/benchmarks.md shows
            "requests": self.total(),
            "seconds": round(time.monotonic() - self.started, 1),
            "crashes": self.total("crash"),
            "hangs": self.total("hang"),
            "unanswered": self.total("unanswered"),
            "without_message": self.total("silent"),
            "legitimate_waits": self.total("waited"),
            "setup_calls": self.setup_calls,
            "rpcs": {
                rpc: {
                    "requests": sum(self.verdicts[rpc].values()),
                    "statuses": dict(sorted(self.statuses[rpc].items())),
                    "verdicts": dict(sorted(self.verdicts[rpc].items())),
                }
                for rpc in sorted(self.statuses)
            },
        }


class Harness:
    """Runs the mesh (manager, weights, one torch-engine rollout instance on the tiny model) and a
    standalone trainer status server on an event loop in a thread of their own. Calls go through
    the synchronous gRPC client from the test's thread, so encoding a large request never stalls a
    server, and hypothesis drives plain functions. (The asyncio client reports INTERNAL "Internal
    error from Core" instead of the server's status when a server ends a client stream before the
    client finished writing it: grpc/grpc#36066; the synchronous one reports the server's.)"""

    def __init__(self, model_dir) -> None:
        self.model_dir = model_dir
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fuzz-servers", daemon=True)
        self._thread.start()
        self.stats = Stats()
        """Names a crash already recorded as a finding of code this harness may not fix."""
        self.mesh: Mesh | None = None
        self.trainer: GrpcServer | None = None
        self.servers: dict[str, GrpcServer] = {}
        self.channels: dict[str, grpc.Channel] = {}
        self.secret_of = peer_secrets(TEST_SECRETS)
        """Every call presents the secret of a role allowed to make it: authorization stays on."""

    def _run(self, work: Coroutine[Any, Any, Any], timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout)

    def start(self) -> None:
        self._run(self._start(), 120)
        # The client may send one megabyte past every server's limit, to test that limit.
        self.channels = {
            name: grpc.insecure_channel(server.address, options=channel_options(server.config.max_message_mb + 1))
            for name, server in self.servers.items()
        }

    async def _start(self) -> None:
        # A small version limit: a header that declares a huge payload must be refused, not allocated.
        self.mesh = await build_mesh(self.model_dir, "grpc", weights_settings={"max_version_gb": 1.0}, relay_shards=1)
        self.trainer = GrpcServer(loopback(), [trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name])
        status = TrainingStatus(total_steps=10, output_dir="runs/fuzz", metrics={"reward": 0.5, "loss": float("nan")})
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server(TrainerServicer(status), self.trainer.server)
        await self.trainer.start()
        await self.trainer.set_serving(True)
        self.servers = {
            "manager": self.mesh.manager.server,
            "relay": self.mesh.relays[0].server,
            "rollout": self.mesh.rollouts[0].server,
            "weights": self.mesh.weights.server,
            "trainer": self.trainer,
        }

    def stop(self) -> None:
        async def stop_servers() -> None:
            if self.trainer:
                await self.trainer.stop()
            if self.mesh:
                await stop_mesh(self.mesh)

        try:
            for channel in self.channels.values():
                channel.close()
            self._run(stop_servers(), 60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)

    def address(self, service: str) -> str:
        return self.servers[service].address

    def max_receive_bytes(self, service: str) -> int:
        return self.servers[service].config.max_message_mb << 20

    def call(self, rpc: Rpc, requests: Wire | Sequence[Wire], may_wait: bool = False, setup: bool = False) -> Outcome:
        """Sends a request (a sequence of them to a client-streaming RPC), reads a stream to its end
        or first error, and records the outcome; `may_wait`: the call legitimately waits, so it gets
        a short deadline and running into it is no hang."""
        timeout = WAIT_TIMEOUT if may_wait else CALL_TIMEOUT
        channel = self.channels[rpc.service]
        kind = ("stream" if rpc.client_streaming else "unary") + "_" + ("stream" if rpc.server_streaming else "unary")
        stub = getattr(channel, kind)(
            rpc.path, request_serializer=Wire.encode, response_deserializer=rpc.response.FromString
        )
        if rpc.client_streaming:
            argument = iter([requests] if isinstance(requests, Wire) else list(requests))
        else:
            argument = requests
        metadata = (("authorization", f"Bearer {self.secret_of(rpc.path)}"),)
        started = time.monotonic()
        responses = 0
        try:
            if rpc.server_streaming:
                for _ in stub(argument, timeout=timeout, metadata=metadata):
                    responses += 1
            else:
                stub(argument, timeout=timeout, metadata=metadata)
                responses = 1
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
        outcome = Outcome(rpc.key, code, details, time.monotonic() - started, responses, may_wait)
        if setup:
            self.stats.setup_calls += 1
        else:
            self.stats.record(outcome)
        return outcome

    def health(self) -> dict[str, str]:
        """Each server's answer to grpc.health.v1.Health/Check, or why there was none."""
        answers = {}
        for service, channel in self.channels.items():
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=CALL_TIMEOUT)
                answers[service] = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as exc:
                answers[service] = exc.code().name
        return answers
