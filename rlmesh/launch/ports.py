"""Ports: free ones for tests and benchmarks, the ports a mesh takes from its base, and where a
service serves its Prometheus metrics."""

from __future__ import annotations

import random
import socket

from rlmesh.config import METRICS_PORT_OFFSET

MESH_PORT_OFFSETS = tuple(range(26))
"""Ports `rlmesh up` takes from its base: manager, weights, trainer, the manager's OpenAI gateway,
up to 6 relay shards and up to 16 rollout instances, each with its metrics port METRICS_PORT_OFFSET
above (the shards serve none)."""


def port_of(address: str) -> str:
    return address.rsplit(":", 1)[1]


def metrics_address(address: str) -> str:
    """Where the service at gRPC `address` serves Prometheus `/metrics`."""
    host, port = address.rsplit(":", 1)
    return f"{host}:{int(port) + METRICS_PORT_OFFSET}"


def metrics_setting(prefix: str, address: str) -> dict[str, str]:
    """The environment setting that puts the metrics port of the service at `address` beside its gRPC port."""
    return {f"{prefix}_SERVER__METRICS_PORT": port_of(metrics_address(address))}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _port_free(port: int, host: str) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


BASE_PORTS = range(20000, 31000)
"""Where `free_base_port` draws from: below the kernel's ephemeral ports, which outgoing
connections take at random (one landing on a mesh port would stop a service from binding it).
Processes that start meshes side by side (the test suite's workers) each narrow it to a slice of
their own: a port free when drawn is not yet bound, and another process could draw it too."""


def free_base_port(host: str = "127.0.0.1") -> int:
    """A base port for a mesh on `host` (tests, benchmarks) whose every port is free now."""
    while True:
        base = random.choice(BASE_PORTS)
        if all(
            _port_free(base + offset + extra, host)
            for offset in MESH_PORT_OFFSETS
            for extra in (0, METRICS_PORT_OFFSET)
        ):
            return base
