"""Fuzzing the OpenAI gateway over HTTP: generated bodies and header combinations (tests/fuzz/
gateway_requests.py) against a live gateway process and a live manager with a torch instance on
loopback. Every request is answered within a bound, never with a 5xx; every 4xx carries an
OpenAI-style error message, and a 400 that names a field names one the request changed; the gateway
process never dies. A bounded run here; RLMESH_FUZZ_REQUESTS=10000 is `make fuzz`."""

from __future__ import annotations

import asyncio
import json
import os
import random
import select
import socket
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import httpx
import pytest

from rlmesh.common.v1 import common_pb2
from rlmesh.manager.v1 import manager_pb2, manager_pb2_grpc
from rlmesh.models.tokenizer import IM_END_TOKEN, load_hf_tokenizer
from rlmesh.rpc.channels import open_channel
from tests.fuzz.gateway_requests import Generator, Request, Session
from tests.support.meshes import build_mesh, stop_mesh

REQUESTS = int(os.environ.get("RLMESH_FUZZ_REQUESTS", "0"))
"""Generated requests (`make fuzz`: 10,000); 0 is the bounded run of `make test`."""
RESULTS = os.environ.get("RLMESH_FUZZ_RESULTS", "")
"""Where the figures go: the file's "gateway" section (the RPC fuzz keeps the rest)."""
BOUNDED_REQUESTS = 300
ANSWER_SECONDS = 30.0
STRANGERS = frozenset({"session:wrong-key", "session:no-key", "session:unknown", "session:malformed"})
"""Requests presenting no key of the session they name: no answer but /healthz's may be a success."""
"""A request not answered (to its last byte) within this is a hang."""
SESSIONS_AT_ONCE = 4
ROTATE_EVERY = 40
"""Requests between two rotations: the open sessions are closed and new ones opened, so turns keep
running on fresh sessions while closed ones stay to be asked for."""


class GatewayHarness:
    """A mesh with its gateway, served from an event loop in a thread of its own, and the sessions
    the requests are for."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="gateway-fuzz-servers", daemon=True)
        self._thread.start()
        self.open: list[Session] = []
        self.closed: list[Session] = []
        self.setup_calls = 0
        self._batches = 0
        stop = load_hf_tokenizer(model_dir).convert_tokens_to_ids(IM_END_TOKEN)
        self.sampling = common_pb2.SamplingParams(temperature=1.0, max_tokens=6, stop_token_ids=[stop], seed=3)

    def _run(self, work, timeout: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout)

    def start(self) -> None:
        async def start() -> None:
            self.mesh = await build_mesh(self.model_dir, "grpc", gateway=True)
            self.channel = open_channel(self.mesh.manager_address)
            self.manager = manager_pb2_grpc.ManagerServiceStub(self.channel)

        self._run(start())
        self.address = self.mesh.manager.gateway_address
        self.gateway_pid = self.mesh.manager.gateway.process.pid

    def stop(self) -> None:
        async def stop() -> None:
            await self.channel.close()
            await stop_mesh(self.mesh)

        try:
            self._run(stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)

    def rotate(self) -> None:
        async def rotate() -> list[manager_pb2.SessionHandle]:
            for session in self.open:
                await self.manager.CloseSession(
                    manager_pb2.CloseSessionRequest(
                        session_id=session.session_id, status=manager_pb2.SESSION_STATUS_DONE
                    ),
                    timeout=10,
                )
            self._batches += 1
            reply = await self.manager.OpenSessions(
                manager_pb2.OpenSessionsRequest(
                    batch_id=f"fuzz-{self._batches}",
                    policy_version=0,
                    task="fuzz",
                    sampling=self.sampling,
                    prompts=[manager_pb2.Prompt(prompt_id="p", n=SESSIONS_AT_ONCE)],
                    limits=manager_pb2.SessionLimits(max_turns=64),
                ),
                timeout=10,
            )
            return list(reply.sessions)

        handles = self._run(rotate())
        self.setup_calls += len(self.open) + 1
        self.closed = (self.closed + self.open)[-8:]
        self.open = [Session(h.session_id, h.key) for h in handles]


def send_oversize(address: str, request: Request) -> tuple[int, bytes, int]:
    """A body over the limit, over a socket of its own: its Content-Length declared with little of it
    sent, or streamed in chunks until the gateway answers. Returns the status, the body and the
    bytes sent."""
    host, port = address.rsplit(":", 1)
    head = "".join(f"{name}: {value}\r\n" for name, value in request.headers.items())
    assert request.body is not None
    sent = 0
    with socket.create_connection((host, int(port)), timeout=ANSWER_SECONDS) as sock:
        start = f"{request.method} {request.path} HTTP/1.1\r\nhost: {address}\r\n{head}"
        if request.oversize == "declared":
            sock.sendall(f"{start}content-length: {len(request.body)}\r\n\r\n".encode() + request.body[:4096])
            sent = 4096
        else:
            sock.sendall(f"{start}transfer-encoding: chunked\r\n\r\n".encode())
            for offset in range(0, len(request.body), 256 << 10):
                if select.select([sock], [], [], 0)[0]:
                    break  # the gateway answered: it reads no more
                chunk = request.body[offset : offset + (256 << 10)]
                try:
                    sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                except OSError:
                    break
                sent += len(chunk)
            else:
                sock.sendall(b"0\r\n\r\n")
        reply = b""
        while True:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            reply += data
            head_end = reply.find(b"\r\n\r\n")
            length = (
                next(
                    (
                        int(line.split(b":")[1])
                        for line in reply[:head_end].split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    None,
                )
                if head_end >= 0
                else None
            )
            if length is not None and len(reply) >= head_end + 4 + length:
                break
    status = int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0
    return status, reply[reply.find(b"\r\n\r\n") + 4 :], sent


class Figures:
    """Answers by status and by what was varied, and what broke a rule (with the first examples)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.started = time.monotonic()
        self.statuses: Counter[str] = Counter()
        self.kinds: dict[str, Counter[str]] = defaultdict(Counter)
        self.broken: dict[str, int] = Counter()
        self.examples: list[str] = []
        self.slowest = 0.0
        self.oversize_sent_max = 0
        self.stream_events = 0

    def breaks(self, rule: str, request: Request, detail: str) -> None:
        self.broken[rule] += 1
        if len(self.examples) < 10:
            self.examples.append(
                f"{rule}: {request.kind} {request.method} {request.path[:120]} body {(request.body or b'')[:300]!r}: "
                f"{detail[:500]}"
            )

    def record(self, request: Request, status: int, body: bytes, seconds: float) -> None:
        self.statuses[str(status)] += 1
        self.kinds[request.kind][str(status)] += 1
        self.slowest = max(self.slowest, seconds)
        if seconds > ANSWER_SECONDS:
            self.breaks("hangs", request, f"answered after {seconds:.1f} s")
        if status >= 500 or status == 0:
            self.breaks("server_errors" if status else "unanswered", request, body.decode(errors="replace"))
            return
        if status < 400 and request.kind in STRANGERS and not request.path.startswith("/healthz"):
            self.breaks("stranger_served", request, f"{status}: {body[:300]!r}")
        if status >= 400:
            self._check_refusal(request, status, body)
        elif body.startswith(b"data: "):
            for line in body.split(b"\n"):
                if line.startswith(b"data: {"):
                    self.stream_events += 1
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.breaks("stream_errors", request, json.dumps(event))

    def _check_refusal(self, request: Request, status: int, body: bytes) -> None:
        try:
            error = json.loads(body)["error"]
            message, param = error["message"], error.get("param")
        except (ValueError, KeyError, TypeError):
            self.breaks("without_message", request, f"{status}: {body[:300]!r}")
            return
        if not isinstance(message, str) or not message.strip():
            self.breaks("without_message", request, f"{status}: {body[:300]!r}")
        elif param is not None and (
            not message.startswith(f"{param}: ")
            or (request.mutated and not any(param.startswith(name) for name in request.mutated))
        ):
            self.breaks(
                "misnamed_field",
                request,
                f"{status} names {param!r}, the request changed {sorted(request.mutated)}: {message}",
            )

    def report(self, setup_calls: int, gateway_restarts: int) -> dict[str, Any]:
        return {
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),  # the day docs/benchmarks.md shows
            "requests": sum(self.statuses.values()),
            "seconds": round(time.monotonic() - self.started, 1),
            "seed": self.seed,
            "server_errors": self.broken["server_errors"],
            "hangs": self.broken["hangs"],
            "unanswered": self.broken["unanswered"],
            "without_message": self.broken["without_message"],
            "misnamed_field": self.broken["misnamed_field"],
            "strangers_served": self.broken["stranger_served"],
            "stream_errors": self.broken["stream_errors"],
            "gateway_restarts": gateway_restarts,
            "slowest_answer_seconds": round(self.slowest, 2),
            "oversize_bytes_sent_at_most": self.oversize_sent_max,
            "stream_events": self.stream_events,
            "setup_calls": setup_calls,
            "statuses": dict(sorted(self.statuses.items())),
            "kinds": {kind: dict(sorted(counts.items())) for kind, counts in sorted(self.kinds.items())},
        }


def write_results(report: dict[str, Any]) -> None:
    path = Path(RESULTS)
    path.parent.mkdir(parents=True, exist_ok=True)
    figures = json.loads(path.read_text()) if path.is_file() else {}
    figures["gateway"] = report
    path.write_text(json.dumps(figures, indent=2) + "\n")


@pytest.fixture(scope="module")
def harness(chat_model_dir):
    harness = GatewayHarness(chat_model_dir)
    harness.start()
    try:
        yield harness
    finally:
        harness.stop()


def test_the_gateway_answers_every_generated_request(harness):
    # The bounded run draws the same requests every time; the full run draws afresh (its seed is reported).
    seed = 0 if not REQUESTS else random.SystemRandom().randrange(2**32)
    generator, figures = Generator(seed), Figures(seed)
    with httpx.Client(base_url=f"http://{harness.address}", timeout=ANSWER_SECONDS) as client:
        for index in range(REQUESTS or BOUNDED_REQUESTS):
            if index % ROTATE_EVERY == 0:
                harness.rotate()
            request = generator.request(harness.open, harness.closed)
            started = time.monotonic()
            if request.oversize:
                status, body, sent = send_oversize(harness.address, request)
                figures.oversize_sent_max = max(figures.oversize_sent_max, sent)
            else:
                try:
                    reply = client.request(request.method, request.path, headers=request.headers, content=request.body)
                    status, body = reply.status_code, reply.content
                except httpx.TimeoutException as exc:
                    status, body = 0, f"no answer within {ANSWER_SECONDS:g} s: {exc!r}".encode()
                    figures.breaks("hangs", request, body.decode())
                except httpx.HTTPError as exc:
                    status, body = 0, repr(exc).encode()
            figures.record(request, status, body, time.monotonic() - started)
    health = httpx.get(f"http://{harness.address}/healthz", timeout=ANSWER_SECONDS)
    restarts = int(harness.mesh.manager.gateway.process.pid != harness.gateway_pid)
    report = figures.report(harness.setup_calls, restarts)
    if RESULTS:
        write_results(report)
    assert health.status_code == 200 and not restarts, "the gateway process died during the fuzz"
    assert not figures.broken, f"{dict(figures.broken)}; first: {figures.examples}"
