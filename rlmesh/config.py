"""Typed service configuration: a TOML file plus environment overrides, validated at start."""

from __future__ import annotations

import json
import os
import socket
import tomllib
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

METRICS_PORT_OFFSET = 1000
"""`rlmesh up`, the compose file and the Kubernetes manifests serve a service's `/metrics` on its
gRPC port + this."""
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
"""Bind addresses that listen on every interface: never an address to hand to another service."""

ConfigT = TypeVar("ConfigT", bound=BaseModel)


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the bad field."""


class StrictModel(BaseModel):
    """Base for config sections: unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class TlsFiles(StrictModel):
    """Mutual TLS: this process's certificate and key, and the CA its peers' certificates must be
    signed by (PEM files; `rlmesh certs` makes a local CA and a certificate per service)."""

    ca_file: str
    cert_file: str
    key_file: str

    @field_validator("ca_file", "cert_file", "key_file")
    @classmethod
    def _readable(cls, path: str) -> str:
        if not Path(path).is_file():
            raise ValueError(f"{path} is not a file")
        if not os.access(path, os.R_OK):
            raise ValueError(f"{path} is not readable by this process")
        return path

    @classmethod
    def in_directory(cls, directory: str | Path, name: str) -> TlsFiles:
        """The files `rlmesh certs` writes for `name` (a service, or `client` for tools):
        ca.pem, NAME.pem, NAME-key.pem. Raises ConfigError naming a missing one."""
        directory = Path(directory)
        try:
            return cls(
                ca_file=str(directory / "ca.pem"),
                cert_file=str(directory / f"{name}.pem"),
                key_file=str(directory / f"{name}-key.pem"),
            )
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors())
            raise ConfigError(f"TLS files of {name} in {directory}: {problems}") from exc


class AuthSettings(StrictModel):
    """How callers prove their role (see docs/security.md). Authorization is on unless `insecure`."""

    insecure: bool = False
    """Serve every RPC to anyone who reaches the port, with no credential: a mesh on one trusted
    machine only. Reported at start and in GetStatus."""
    verifiers_file: str = ""
    """The SHA-256 digests of each role's bearer secret (`rlmesh secrets` writes verifiers.json);
    a caller presenting one of them in `authorization: Bearer <secret>` has that role. Not needed
    under mutual TLS, where the client certificate names the role."""
    secret_file: str = ""
    """This process's own bearer secret, sent with every call it makes (`rlmesh secrets` writes
    ROLE.secret)."""


class ServerSettings(StrictModel):
    """A service's gRPC server limits and log level, which a job sets per service."""

    max_message_mb: int = Field(default=64, ge=4, le=1024)
    """Largest gRPC message accepted or sent."""
    grace_seconds: float = Field(default=5.0, ge=0)
    """How long in-flight calls may finish after SIGTERM."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """The least severe log lines the service writes."""


class ServerConfig(ServerSettings):
    """Listening socket and gRPC server limits shared by every service."""

    host: str = "127.0.0.1"
    """Interface to bind; 0.0.0.0 in containers."""
    port: int = Field(default=0, ge=0, le=65535)
    """TCP port; 0 picks a free one (tests)."""
    advertise_host: str = ""
    """Host other services use to reach this one; defaults to `host`, or to this machine's hostname
    when `host` is a wildcard (0.0.0.0 or ::), as in a container."""
    tls: TlsFiles | None = None
    """Mutual TLS for this server and for every call the process makes (None: plaintext)."""
    auth: AuthSettings = AuthSettings()
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    """Port of the Prometheus `/metrics` endpoint, on `host` (0 picks a free one; None: none)."""

    @property
    def advertised_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        return socket.gethostname() if self.host in WILDCARD_HOSTS else self.host


def _set_path(tree: dict[str, Any], path: list[str], value: str) -> None:
    node = tree
    for key in path[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"environment override {'.'.join(path)}: {key} is not a section")
    node[path[-1]] = value


def load_config(
    model: type[ConfigT],
    path: str | Path | None = None,
    env_prefix: str = "",
    environ: dict[str, str] | None = None,
    overrides: dict[str, Any] | None = None,
) -> ConfigT:
    """Builds `model` from a TOML file, then `PREFIX_SECTION__FIELD` environment variables,
    then explicit overrides; raises ConfigError naming the offending field."""
    data: dict[str, Any] = {}
    if path:
        try:
            text = Path(path).read_text()
            # JSON is what `rlmesh up` writes for a service from a job; people write TOML.
            data = json.loads(text) if str(path).endswith(".json") else tomllib.loads(text)
        except FileNotFoundError as exc:
            raise ConfigError(f"config file not found: {path}") from exc
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(
                f"config file {path} is not valid {'JSON' if str(path).endswith('.json') else 'TOML'}: {exc}"
            ) from exc
    environ = os.environ if environ is None else environ
    if env_prefix:
        for name, value in environ.items():
            if name.startswith(env_prefix):
                keys = name[len(env_prefix) :].lower().split("__")
                _set_path(data, keys, value)
    for dotted, value in (overrides or {}).items():
        node = data
        keys = dotted.split(".")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(f"invalid {model.__name__}: {problems}") from exc
