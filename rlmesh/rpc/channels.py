"""The client side of the mesh's gRPC: channel options and keepalive, deadlines and request ids on
every call, and the process's own identity (mutual TLS and bearer secret) on every channel it opens."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlmesh.config import ConfigError, ServerConfig, TlsFiles
from rlmesh.rpc.credentials import read_secret

REQUEST_ID_KEY = "x-request-id"
AUTHORIZATION_KEY = "authorization"


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
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


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


def open_user_channel(
    address: str, bearer_token: str = "", max_message_mb: int = 64, keepalive: Keepalive = KEEPALIVE
) -> grpc.aio.Channel:
    """A channel to a user's service (a remote verifier or environment), outside the mesh: it
    carries none of this process's mesh identity (no role's secret, no client certificate), only
    `authorization: Bearer <bearer_token>` when a token is given (the task's own credential)."""
    channel = grpc.aio.insecure_channel(address, options=channel_options(max_message_mb, keepalive))
    return _ChannelWithSecret(channel, lambda method: bearer_token) if bearer_token else channel  # type: ignore[return-value]


def call_options(timeout: float) -> dict[str, Any]:
    """Keyword arguments for a stub call: its deadline and the caller's request id."""
    request_id = structlog.contextvars.get_contextvars().get("request_id") or uuid.uuid4().hex[:16]
    return {"timeout": timeout, "metadata": ((REQUEST_ID_KEY, request_id),)}


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
