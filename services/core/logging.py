"""structlog configured once per process.

JSON lines when stderr is not a TTY (containers, CI), a console renderer
otherwise. Standard-library loggers go through the same processors, and
request context is merged from contextvars.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

import structlog

__all__ = ["configure_logging", "get_logger", "capture_json_logs"]

_configured = False

_SHARED: list[Any] = [
    structlog.contextvars.merge_contextvars,
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
    structlog.processors.StackInfoRenderer(),
]


def _route_structlog_to_stdlib() -> None:
    structlog.configure(
        processors=[*_SHARED, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )


def _formatter(*, json: bool) -> logging.Formatter:
    renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=_SHARED,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            renderer,
        ],
    )


def configure_logging(level: str = "INFO", *, json: bool | None = None) -> None:
    global _configured
    if _configured:
        return
    _configured = True
    use_json = (not sys.stderr.isatty()) if json is None else json
    _route_structlog_to_stdlib()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_formatter(json=use_json))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("aiosqlite", "sqlalchemy.engine", "alembic.runtime.migration", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    logger: structlog.stdlib.BoundLogger = structlog.stdlib.get_logger(name)
    return logger


@contextmanager
def capture_json_logs(stream: IO[str], level: str = "INFO") -> Iterator[None]:
    """Also writes every log line of this process, as the JSON a container
    would emit, to ``stream`` while the block runs (a test hook). Routes
    structlog through the standard library if nothing configured it yet."""
    if not _configured:
        _route_structlog_to_stdlib()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(_formatter(json=True))
    handler.setLevel(level.upper())
    root = logging.getLogger()
    previous = root.level
    root.addHandler(handler)
    root.setLevel(min(previous, handler.level) if previous else handler.level)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(previous)
