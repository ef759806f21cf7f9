"""structlog setup: JSON lines for services, readable console output on a terminal, and repeated
events rate-limited with a count."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, MutableMapping
from typing import Any

import structlog

REPEAT_WINDOW_SECONDS = 10.0
REPEATS_PER_WINDOW = 5
"""Of one event, at most this many lines per window are written."""
PER_REQUEST_FIELDS = frozenset({"request", "request_id", "tokens_kept", "timestamp", "exc_info"})
"""What differs between two lines of the same event repeated request after request: ignored when
telling whether two events are the same."""
MAX_TRACKED_EVENTS = 4096


class RepeatLimiter:
    """A structlog processor: once an event (its message, level and fields, less the per-request
    ones) has been written REPEATS_PER_WINDOW times in a window, the rest of that window's are
    dropped, and the first line written after them counts them (`repeats_dropped`). A failure that
    repeats on every request (an engine that died) then costs a few lines every few seconds, not a
    line per request."""

    def __init__(
        self,
        window: float = REPEAT_WINDOW_SECONDS,
        limit: int = REPEATS_PER_WINDOW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window, self.limit, self.clock = window, limit, clock
        self._seen: dict[tuple, tuple[float, int, int]] = {}
        """By event: (window start, lines written in it, lines dropped since the last written)."""

    def __call__(self, logger: Any, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        key = (method, *sorted((name, str(value)) for name, value in event.items() if name not in PER_REQUEST_FIELDS))
        now = self.clock()
        started, written, dropped = self._seen.get(key, (now, 0, 0))
        if now - started >= self.window:
            started, written = now, 0
        if written >= self.limit:
            self._seen[key] = (started, written, dropped + 1)
            raise structlog.DropEvent
        if dropped:
            event["repeats_dropped"] = dropped
        self._seen[key] = (started, written + 1, 0)
        if len(self._seen) > MAX_TRACKED_EVENTS:
            # Only events being held back need remembering: one forgotten starts a window afresh.
            self._seen = {k: v for k, v in self._seen.items() if v[1] >= self.limit or v[2]}
            if len(self._seen) > MAX_TRACKED_EVENTS // 2:
                self._seen.clear()
        return event


class _CurrentStderr:
    """Whatever sys.stderr is when a line is written, not when logging was configured: a process
    that swaps it (pytest's capture) never has its log lines sent to a closed stream."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str = "info", service: str = "", json: bool | None = None) -> None:
    """Routes structlog and stdlib logging to stderr; JSON unless stderr is a terminal."""
    use_json = not sys.stderr.isatty() if json is None else json
    processors: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        RepeatLimiter(),
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    )
    if use_json:
        processors.append(structlog.processors.format_exc_info)
    numeric = logging.getLevelNamesMapping()[level.upper()]
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # One write per line (print() writes the newline apart): processes sharing a log file,
        # like torchrun's ranks, then never interleave inside a line.
        logger_factory=structlog.WriteLoggerFactory(_CurrentStderr()),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=sys.stderr)
    structlog.contextvars.clear_contextvars()
    if service:
        structlog.contextvars.bind_contextvars(service=service)
