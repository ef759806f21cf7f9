"""The server side of the mesh's gRPC: a server with reflection, health and a graceful drain,
authorization of each call by its caller's role, request ids bound to logs, and domain errors
turned into statuses."""

from __future__ import annotations

import asyncio
import inspect
import signal
import uuid
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rlmesh import errors
from rlmesh.config import ConfigError, ServerConfig
from rlmesh.rpc.authz import OPEN_SERVICES, Role, allowed_roles, service_of
from rlmesh.rpc.channels import AUTHORIZATION_KEY, KEEPALIVE, REQUEST_ID_KEY, Keepalive, TlsCredentials, server_options
from rlmesh.rpc.credentials import Verifiers
from rlmesh.rpc.tls import role_of_certificate

if TYPE_CHECKING:
    from rlmesh.rpc.prometheus import Collect, MetricsEndpoint

log = structlog.get_logger()


_STATUS_OF_ERROR: dict[type[errors.DomainError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.Aborted: grpc.StatusCode.ABORTED,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.OutOfRange: grpc.StatusCode.OUT_OF_RANGE,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
}


class Authorizer:
    """Whether a caller may call a method: its role, from the client certificate under mutual TLS
    or else from its bearer secret, must be one the authorization table allows."""

    def __init__(self, verifiers: Verifiers | None, certificates: bool) -> None:
        self.verifiers = verifiers
        self.certificates = certificates

    @classmethod
    def from_config(cls, config: ServerConfig) -> Authorizer | None:
        """None when the config turns authorization off; ConfigError when it is on with nothing
        to learn a caller's role from."""
        if config.auth.insecure:
            return None
        if config.tls is None and not config.auth.verifiers_file:
            raise ConfigError(
                "server.auth: every call is authorized by its caller's role, and this service has neither mutual "
                "TLS (server.tls) nor a verifiers file (server.auth.verifiers_file) to learn it from: make the "
                "secrets with `rlmesh secrets DIR` and set server.auth.verifiers_file = DIR/verifiers.json, or "
                "turn authorization off with server.auth.insecure = true"
            )
        return cls(
            Verifiers(config.auth.verifiers_file) if config.auth.verifiers_file else None, config.tls is not None
        )

    def role_of(self, metadata: dict[str, Any], context: grpc.aio.ServicerContext) -> tuple[Role | None, str]:
        """The caller's role, or None with why not."""
        if self.certificates:
            pem = context.auth_context().get("x509_pem_cert")
            if pem and (role := role_of_certificate(pem[0])) is not None:
                return role, ""
        presented = metadata.get(AUTHORIZATION_KEY, "")
        if not isinstance(presented, str) or not presented:
            return None, "it presented no credential"
        if self.verifiers is None or not presented.startswith("Bearer "):
            return None, "its credential is not a bearer secret this service knows"
        role = self.verifiers.role_of(presented[len("Bearer ") :])
        return role, "" if role is not None else "the bearer secret it presented is no role's"

    def refusal(
        self, method: str, metadata: dict[str, Any], context: grpc.aio.ServicerContext
    ) -> tuple[grpc.StatusCode, str, Role | None] | None:
        """The status a call must be refused with and why, or None when it may go on."""
        name = method.rsplit("/", 1)[-1]
        role, why = self.role_of(metadata, context)
        if role is None:
            return (
                grpc.StatusCode.UNAUTHENTICATED,
                f"{name} needs a credential: a client certificate naming a role, or "
                f"`authorization: Bearer <secret>` with a role's secret ({why}; see docs/security.md)",
                None,
            )
        allowed = allowed_roles(method)
        if role not in allowed:
            return (
                grpc.StatusCode.PERMISSION_DENIED,
                f"{name} is not open to the {role} role (allowed: {', '.join(sorted(allowed)) or 'none'})",
                role,
            )
        return None


def status_code_of(exc: errors.DomainError) -> grpc.StatusCode:
    return next((code for kind, code in _STATUS_OF_ERROR.items() if isinstance(exc, kind)), grpc.StatusCode.UNKNOWN)


async def _abort_for(exc: errors.DomainError, context: grpc.aio.ServicerContext) -> None:
    await context.abort(status_code_of(exc), str(exc))


class RequestContextInterceptor(grpc.aio.ServerInterceptor):
    """Authorizes each call by its caller's role (unless `authorizer` is None: --insecure), binds a
    request id (from metadata, else new) to its logs and turns domain errors into gRPC statuses,
    so servicers stay parse-validate-delegate. A refused call's request is never read."""

    def __init__(self, authorizer: Authorizer | None = None) -> None:
        self.authorizer = authorizer

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None:
            return None
        metadata = dict(details.invocation_metadata or ())
        method = details.method
        bound = {"request_id": metadata.get(REQUEST_ID_KEY) or uuid.uuid4().hex[:16], "method": method}
        authorizer = None if service_of(method) in OPEN_SERVICES else self.authorizer

        async def refused(context: grpc.aio.ServicerContext) -> bool:
            if authorizer is None:
                return False
            refusal = authorizer.refusal(method, metadata, context)
            if refusal is None:
                return False
            code, message, role = refusal
            log.warning("call refused", code=code.name, role=role, reason=message)
            await context.abort(code, message)
            return True

        def unary(fn: Callable[..., Any]) -> Callable[..., Any]:
            async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
                with structlog.contextvars.bound_contextvars(**bound):
                    if await refused(context):
                        return None
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
                    if await refused(context):
                        return
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
    """A grpc.aio server with reflection, the health service, authorization by role and a graceful
    drain; mutual TLS when its config names certificates. Raises ConfigError when authorization
    is on and the config gives no way to learn a caller's role."""

    def __init__(self, config: ServerConfig, service_names: Iterable[str], keepalive: Keepalive = KEEPALIVE) -> None:
        self.config = config
        self.service_names = list(service_names)
        self.authorizer = Authorizer.from_config(config)
        self.server = grpc.aio.server(
            interceptors=[RequestContextInterceptor(self.authorizer)],
            options=server_options(config.max_message_mb, keepalive),
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        self.port = 0
        self.metrics: MetricsEndpoint | None = None

    @property
    def address(self) -> str:
        return f"{self.config.advertised_host}:{self.port}"

    async def serve_metrics(self, service: str, collect: Collect) -> None:
        """Prometheus `/metrics` on the configured metrics port, if the config names one."""
        if self.config.metrics_port is not None:
            # Imported here: `rlmesh health`, which containers run every few seconds, needs none of it.
            from rlmesh.rpc.prometheus import MetricsEndpoint

            self.metrics = MetricsEndpoint(service, self.config.host, self.config.metrics_port, collect)
            await self.metrics.start()

    async def start(self) -> None:
        bind = f"{self.config.host}:{self.config.port}"
        if self.config.tls is not None:
            self.port = self.server.add_secure_port(bind, TlsCredentials.load(self.config.tls).server())
        else:
            self.port = self.server.add_insecure_port(bind)
        if self.port == 0:
            raise OSError(f"cannot bind {self.config.host}:{self.config.port}")
        await self.server.start()
        log.info("listening", address=self.address, tls=self.config.tls is not None, authorization=self.authorization)
        if self.authorizer is None:
            log.warning(
                "authorization is off (insecure): anyone who reaches this port may call every RPC", address=self.address
            )

    @property
    def authorization(self) -> str:
        """How callers prove their role here: "off", "mutual TLS", "bearer secrets" or both."""
        if self.authorizer is None:
            return "off"
        ways = ["mutual TLS"] if self.authorizer.certificates else []
        return " + ".join([*ways, "bearer secrets"] if self.authorizer.verifiers is not None else ways)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def stop(self) -> None:
        await self.set_serving(False)
        await self.server.stop(self.config.grace_seconds)
        if self.metrics is not None:
            self.metrics.stop()
        log.info("stopped")


def stop_event_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT: the services' cue to drain and stop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop
