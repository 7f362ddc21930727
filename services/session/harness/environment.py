"""The harness's port to the session's environment: run a command, read and
write a file. ``services.session`` implements it over the Environment
service; a failed call raises the domain error (``services.core.errors``)
it ended with, and this package imports no ``grpc``."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Protocol

from services.core.errors import BerthError, FailedPrecondition, Unavailable

__all__ = ["EnvironmentPort", "CommandOutput", "CommandExit", "CommandEvent", "environment_unusable"]


@dataclass(frozen=True)
class CommandOutput:
    """A chunk of a command's combined stdout and stderr."""

    data: bytes


@dataclass(frozen=True)
class CommandExit:
    """How a command ended; always the last event of its stream."""

    exit_code: int
    timed_out: bool
    duration_ms: int


CommandEvent = CommandOutput | CommandExit


class EnvironmentPort(Protocol):
    """The environment of one session, for the tools of its turns."""

    def exec(self, shell: str, *, cwd: str, timeout_ms: int) -> AsyncGenerator[CommandEvent, None]:
        """Runs ``sh -c shell``: output chunks, then one CommandExit. Closing
        the iterator early (``contextlib.aclosing``) kills the command."""
        ...

    async def read_file(self, path: str, *, limit: int) -> tuple[bytes, bool]:
        """The file's first ``limit`` bytes and whether it was longer."""
        ...

    async def write_file(self, path: str, data: bytes) -> None:
        """Creates or replaces the file with ``data``."""
        ...


def environment_unusable(error: BerthError) -> bool:
    """Whether a failed environment call means the environment itself cannot
    be used (the turn fails with sandbox_error), rather than that the tool's
    input was wrong (the model is told and goes on)."""
    return isinstance(error, (Unavailable, FailedPrecondition)) or type(error) is BerthError
