"""gRPC plumbing shared by every service: server lifecycle, channel options, deadlines, request ids."""

from __future__ import annotations

import asyncio
import inspect
import signal
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rlmesh import errors
from rlmesh.config import ServerConfig

log = structlog.get_logger()

REQUEST_ID_KEY = "x-request-id"

_STATUS_OF_ERROR: dict[type[errors.DomainError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
}


@dataclass(frozen=True, slots=True)
class Keepalive:
    """Keepalive pings let both ends notice a peer that vanished without closing its socket (a
    preempted spot machine). Clients and servers take their settings from the same instance so that
    a server never counts the pings of a client at its own rate as abuse (a GOAWAY "too_many_pings")."""

    time_ms: int = 20_000
    """Each end pings a quiet connection this often (grpc core's clients at most once a second)."""
    timeout_ms: int = 10_000
    """...and closes it when a ping goes unanswered this long."""

    def channel_options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.keepalive_time_ms", self.time_ms),
            ("grpc.keepalive_timeout_ms", self.timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
        ]

    def server_options(self) -> list[tuple[str, int]]:
        # The server's ping policy: pings at least half a period apart are fine, with or without
        # calls in flight (permit_without_calls, above). This is the key grpc core reads for
        # GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS; it ignores unknown keys silently,
        # and under its 5-minute default a client pinging every 20 s is sent away after 3 pings.
        return [*self.channel_options(), ("grpc.http2.min_ping_interval_without_data_ms", self.time_ms // 2)]


KEEPALIVE = Keepalive()


def server_options(max_message_mb: int, keepalive: Keepalive = KEEPALIVE) -> list[tuple[str, int]]:
    return [*_message_limits(max_message_mb), *keepalive.server_options()]


def channel_options(max_message_mb: int = 64, keepalive: Keepalive = KEEPALIVE) -> list[tuple[str, int]]:
    return [*_message_limits(max_message_mb), *keepalive.channel_options()]


def _message_limits(max_message_mb: int) -> list[tuple[str, int]]:
    size = max_message_mb << 20
    return [("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size)]


def open_channel(address: str, max_message_mb: int = 64, keepalive: Keepalive = KEEPALIVE) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=channel_options(max_message_mb, keepalive))


def call_options(timeout: float) -> dict[str, Any]:
    """Keyword arguments for a stub call: its deadline and the caller's request id."""
    request_id = structlog.contextvars.get_contextvars().get("request_id") or uuid.uuid4().hex[:16]
    return {"timeout": timeout, "metadata": ((REQUEST_ID_KEY, request_id),)}


async def _abort_for(exc: errors.DomainError, context: grpc.aio.ServicerContext) -> None:
    code = next(
        (code for kind, code in _STATUS_OF_ERROR.items() if isinstance(exc, kind)),
        grpc.StatusCode.UNKNOWN,
    )
    await context.abort(code, str(exc))


class RequestContextInterceptor(grpc.aio.ServerInterceptor):
    """Binds a request id (from metadata, else new) to the logs of each call and turns domain
    errors into gRPC statuses, so servicers stay parse-validate-delegate."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None:
            return None
        metadata = dict(details.invocation_metadata or ())
        bound = {"request_id": metadata.get(REQUEST_ID_KEY) or uuid.uuid4().hex[:16], "method": details.method}

        def unary(fn: Callable[..., Any]) -> Callable[..., Any]:
            async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
                with structlog.contextvars.bound_contextvars(**bound):
                    try:
                        result = fn(request, context)
                        return await result if inspect.isawaitable(result) else result
                    except errors.DomainError as exc:
                        log.info("request refused", error=str(exc))
                        await _abort_for(exc, context)

            return call

        def streaming(fn: Callable[..., Any]) -> Callable[..., Any]:
            async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
                with structlog.contextvars.bound_contextvars(**bound):
                    try:
                        responses = fn(request, context)
                        if inspect.isasyncgen(responses):
                            async for item in responses:
                                yield item
                        else:
                            for item in responses:
                                yield item
                    except errors.DomainError as exc:
                        log.info("request refused", error=str(exc))
                        await _abort_for(exc, context)

            return call

        kinds = {
            "unary_unary": (grpc.unary_unary_rpc_method_handler, unary),
            "stream_unary": (grpc.stream_unary_rpc_method_handler, unary),
            "unary_stream": (grpc.unary_stream_rpc_method_handler, streaming),
            "stream_stream": (grpc.stream_stream_rpc_method_handler, streaming),
        }
        for attribute, (make_handler, wrap) in kinds.items():
            fn = getattr(handler, attribute)
            if fn is not None:
                return make_handler(
                    wrap(fn),
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
        return handler


class GrpcServer:
    """A grpc.aio server with reflection, the health service and a graceful drain."""

    def __init__(self, config: ServerConfig, service_names: Iterable[str], keepalive: Keepalive = KEEPALIVE) -> None:
        self.config = config
        self.service_names = list(service_names)
        self.server = grpc.aio.server(
            interceptors=[RequestContextInterceptor()],
            options=server_options(config.max_message_mb, keepalive),
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        self.port = 0

    @property
    def address(self) -> str:
        return f"{self.config.advertised_host}:{self.port}"

    async def start(self) -> None:
        self.port = self.server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        if self.port == 0:
            raise OSError(f"cannot bind {self.config.host}:{self.config.port}")
        await self.server.start()
        log.info("listening", address=self.address)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def stop(self) -> None:
        await self.set_serving(False)
        await self.server.stop(self.config.grace_seconds)
        log.info("stopped")


def stop_event_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT: the services' cue to drain and stop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def check_health(address: str, timeout: float = 2.0, service: str = "") -> bool:
    """Whether the server at `address` answers SERVING for `service`."""
    async with open_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), **call_options(timeout))
        except grpc.aio.AioRpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


async def wait_healthy(address: str, timeout: float, service: str = "") -> None:
    """Polls the health service until SERVING; raises TimeoutError naming the address."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check_health(address, timeout=1.0, service=service):
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"{address} did not report SERVING within {timeout:.0f}s")
        await asyncio.sleep(0.2)
