"""gRPC plumbing shared by every service: server lifecycle, channel options, deadlines, request ids,
authorization by role, and the process's own mutual TLS and bearer secret."""

from __future__ import annotations

import asyncio
import inspect
import signal
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rlmesh import errors
from rlmesh.authz import OPEN_SERVICES, Role, allowed_roles, service_of
from rlmesh.config import ConfigError, ServerConfig, TlsFiles
from rlmesh.credentials import Verifiers, read_secret
from rlmesh.tls import role_of_certificate

if TYPE_CHECKING:
    from rlmesh.prometheus import Collect, MetricsEndpoint

log = structlog.get_logger()

REQUEST_ID_KEY = "x-request-id"
AUTHORIZATION_KEY = "authorization"

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


@dataclass(frozen=True, slots=True)
class TlsCredentials:
    """The PEM bytes of a TlsFiles, read once."""

    ca: bytes
    cert: bytes
    key: bytes

    @classmethod
    def load(cls, files: TlsFiles) -> TlsCredentials:
        try:
            return cls(*(Path(path).read_bytes() for path in (files.ca_file, files.cert_file, files.key_file)))
        except OSError as exc:
            raise ConfigError(f"server.tls: cannot read {exc.filename}: {exc.strerror}") from exc

    def server(self) -> grpc.ServerCredentials:
        # Only callers holding a certificate from the same CA get past the handshake.
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True)

    def channel(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert)


@dataclass(slots=True)
class _Identity:
    """How this process calls others: set once at start by the service from its config, because
    channels are opened in many places (clients, pushers, health checks)."""

    channel_credentials: grpc.ChannelCredentials | None = None
    secret_of: Callable[[str], str] | None = None
    """The bearer secret to present on a call of a method (full name); None: present none."""
    tls_files: TlsFiles | None = None


_identity = _Identity()


def use_tls(files: TlsFiles | None) -> None:
    """Every channel this process opens from now on uses mutual TLS with these files (None: plaintext)."""
    _identity.channel_credentials = TlsCredentials.load(files).channel() if files is not None else None
    _identity.tls_files = files


def mesh_tls() -> TlsFiles | None:
    """The TLS files this process calls the mesh with (None: plaintext): the mesh's CA is in them."""
    return _identity.tls_files


def use_secret(secret: str | Callable[[str], str]) -> None:
    """Every call this process makes from now on carries `authorization: Bearer <secret>` ("": none).
    A function of the method's full name picks a secret per call: a test that plays every role."""
    if callable(secret):
        _identity.secret_of = secret
    else:
        _identity.secret_of = (lambda method: secret) if secret else None


def use_server_identity(config: ServerConfig) -> None:
    """This service's calls carry its own certificate and bearer secret, as its config names them."""
    use_tls(config.tls)
    use_secret(read_secret(config.auth.secret_file) if config.auth.secret_file else "")


class _CallWithSecret:
    """A stub's multicallable whose calls also carry a bearer secret for the method."""

    __slots__ = ("_call", "_method", "_secret_of")

    def __init__(self, call: Any, method: str, secret_of: Callable[[str], str]) -> None:
        self._call = call
        self._method = method
        self._secret_of = secret_of

    def __call__(self, *args: Any, metadata: Any = None, **kwargs: Any) -> Any:
        if secret := self._secret_of(self._method):
            metadata = (*(metadata or ()), (AUTHORIZATION_KEY, f"Bearer {secret}"))
        return self._call(*args, metadata=metadata, **kwargs)


def _mesh_secret(method: str) -> str:
    """The secret this process presents on a mesh call of `method`, read at each call ("" for none)."""
    return _identity.secret_of(method) if _identity.secret_of is not None else ""


class _ChannelWithSecret:
    """A grpc.aio channel whose stubs' calls carry a bearer secret (`secret_of` the method's: the
    process's mesh role's, or a user service's own token): wrapping the multicallables a stub makes
    once costs a call a tuple, where a client interceptor would wrap every message."""

    def __init__(self, channel: grpc.aio.Channel, secret_of: Callable[[str], str] = _mesh_secret) -> None:
        self._channel = channel
        self._secret_of = secret_of

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> _CallWithSecret:
        return _CallWithSecret(self._channel.unary_unary(method, *args, **kwargs), method, self._secret_of)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> _CallWithSecret:
        return _CallWithSecret(self._channel.unary_stream(method, *args, **kwargs), method, self._secret_of)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> _CallWithSecret:
        return _CallWithSecret(self._channel.stream_unary(method, *args, **kwargs), method, self._secret_of)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> _CallWithSecret:
        return _CallWithSecret(self._channel.stream_stream(method, *args, **kwargs), method, self._secret_of)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._channel, name)

    async def __aenter__(self) -> _ChannelWithSecret:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self._channel.close()


def open_channel(address: str, max_message_mb: int = 64, keepalive: Keepalive = KEEPALIVE) -> grpc.aio.Channel:
    options = channel_options(max_message_mb, keepalive)
    if _identity.channel_credentials is not None:
        channel = grpc.aio.secure_channel(address, _identity.channel_credentials, options=options)
    else:
        channel = grpc.aio.insecure_channel(address, options=options)
    return _ChannelWithSecret(channel)  # type: ignore[return-value]


def open_user_channel(address: str, bearer_token: str = "", max_message_mb: int = 64,
                      keepalive: Keepalive = KEEPALIVE) -> grpc.aio.Channel:
    """A channel to a user's service (a remote verifier or environment), outside the mesh: it
    carries none of this process's mesh identity (no role's secret, no client certificate), only
    `authorization: Bearer <bearer_token>` when a token is given (the task's own credential)."""
    channel = grpc.aio.insecure_channel(address, options=channel_options(max_message_mb, keepalive))
    return _ChannelWithSecret(channel, lambda method: bearer_token) if bearer_token else channel  # type: ignore[return-value]


def call_options(timeout: float) -> dict[str, Any]:
    """Keyword arguments for a stub call: its deadline and the caller's request id."""
    request_id = structlog.contextvars.get_contextvars().get("request_id") or uuid.uuid4().hex[:16]
    return {"timeout": timeout, "metadata": ((REQUEST_ID_KEY, request_id),)}


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
            raise ConfigError("server.auth: every call is authorized by its caller's role, and this service has neither mutual "
                              "TLS (server.tls) nor a verifiers file (server.auth.verifiers_file) to learn it from: make the "
                              "secrets with `rlmesh secrets DIR` and set server.auth.verifiers_file = DIR/verifiers.json, or "
                              "turn authorization off with server.auth.insecure = true")
        return cls(Verifiers(config.auth.verifiers_file) if config.auth.verifiers_file else None, config.tls is not None)

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
        role = self.verifiers.role_of(presented[len("Bearer "):])
        return role, "" if role is not None else "the bearer secret it presented is no role's"

    def refusal(self, method: str, metadata: dict[str, Any], context: grpc.aio.ServicerContext
                ) -> tuple[grpc.StatusCode, str, Role | None] | None:
        """The status a call must be refused with and why, or None when it may go on."""
        name = method.rsplit("/", 1)[-1]
        role, why = self.role_of(metadata, context)
        if role is None:
            return (grpc.StatusCode.UNAUTHENTICATED, f"{name} needs a credential: a client certificate naming a role, or "
                    f"`authorization: Bearer <secret>` with a role's secret ({why}; see docs/security.md)", None)
        allowed = allowed_roles(method)
        if role not in allowed:
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"{name} is not open to the {role} role (allowed: {', '.join(sorted(allowed)) or 'none'})", role)
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
            from rlmesh.prometheus import MetricsEndpoint

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
            log.warning("authorization is off (insecure): anyone who reaches this port may call every RPC", address=self.address)

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


async def _health(address: str, timeout: float, service: str) -> tuple[bool, str]:
    """Whether `address` answers SERVING for `service`, and otherwise why not."""
    async with open_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), **call_options(timeout))
        except grpc.aio.AioRpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}"
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    return serving, "" if serving else health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def check_health(address: str, timeout: float = 2.0, service: str = "") -> bool:
    """Whether the server at `address` answers SERVING for `service`."""
    serving, _ = await _health(address, timeout, service)
    return serving


async def wait_healthy(address: str, timeout: float, service: str = "") -> None:
    """Polls the health service until SERVING; raises TimeoutError naming the address and the last
    answer (a TLS handshake refused shows here as UNAVAILABLE)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        serving, why = await _health(address, 1.0, service)
        if serving:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"{address} did not report SERVING within {timeout:.0f}s (last answer: {why})")
        await asyncio.sleep(0.2)
