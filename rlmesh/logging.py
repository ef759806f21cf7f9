"""structlog setup: JSON lines for services, readable console output on a terminal."""

from __future__ import annotations

import logging
import sys

import structlog


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
