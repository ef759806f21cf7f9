"""Prometheus `/metrics` of a service: a registry of its own, served over HTTP on its own port.
Every scrape reads the service's state on its event loop, so values are current and never torn."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from wsgiref.simple_server import WSGIServer

import structlog
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = structlog.get_logger()

PREFIX = "rlmesh"
SCRAPE_TIMEOUT_SECONDS = 5.0
"""A scrape waits this long for the event loop; a loop this busy is worth a failed scrape."""


class Families:
    """What one scrape reports: gauges and counters by name, each with its labelled values. Names
    get the `rlmesh_<service>_` prefix; a counter's name gets `_total`."""

    def __init__(self, service: str) -> None:
        self.prefix = f"{PREFIX}_{service}_"
        self._families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

    def gauge(self, name: str, documentation: str, value: float, **labels: str) -> None:
        self._add(GaugeMetricFamily, name, documentation, value, labels)

    def counter(self, name: str, documentation: str, value: float, **labels: str) -> None:
        self._add(CounterMetricFamily, name, documentation, value, labels)

    def _add(
        self,
        kind: type[GaugeMetricFamily] | type[CounterMetricFamily],
        name: str,
        documentation: str,
        value: float,
        labels: dict[str, str],
    ) -> None:
        family = self._families.get(name)
        if family is None:
            family = self._families[name] = kind(self.prefix + name, documentation, labels=sorted(labels))
        elif not isinstance(family, kind):
            raise TypeError(f"metric {name} reported as both a gauge and a counter")
        family.add_metric([labels[key] for key in sorted(labels)], float(value))

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._families.values())


Collect = Callable[[Families], Awaitable[None]]
"""Fills the families of one scrape from the service's state (runs on the service's event loop)."""


class _LoopCollector(Collector):
    def __init__(self, service: str, collect: Collect, loop: asyncio.AbstractEventLoop) -> None:
        self.service, self.collect_on_loop, self.loop = service, collect, loop

    def collect(self) -> Iterator[Metric]:
        async def scrape() -> Families:
            families = Families(self.service)
            await self.collect_on_loop(families)
            return families

        # Called on the HTTP server's thread: the service's state belongs to its loop.
        families = asyncio.run_coroutine_threadsafe(scrape(), self.loop).result(SCRAPE_TIMEOUT_SECONDS)
        return iter(families)


class MetricsEndpoint:
    """`/metrics` on host:port (0: a free port), on a thread of its own."""

    def __init__(self, service: str, host: str, port: int, collect: Collect) -> None:
        self.service, self.host, self.port, self.collect = service, host, port, collect
        self._server: WSGIServer | None = None

    async def start(self) -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_LoopCollector(self.service, self.collect, asyncio.get_running_loop()))
        try:
            self._server, _ = start_http_server(self.port, addr=self.host, registry=registry)
        except OSError as exc:
            raise OSError(f"cannot serve metrics on {self.host}:{self.port}: {exc.strerror}") from exc
        self.port = self._server.server_port
        log.info("serving metrics", address=f"{self.host}:{self.port}", path="/metrics")

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
