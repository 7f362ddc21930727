"""The harness's port to the session's environment: run a command, read and
write a file, and run background processes. ``services.session`` implements it over the Environment
service; a failed call raises the domain error (``services.core.errors``)
it ended with, and this package imports no ``grpc``."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Protocol

from services.core.errors import BerthError, FailedPrecondition, Unavailable

__all__ = [
    "EnvironmentPort",
    "CommandOutput",
    "CommandExit",
    "CommandEvent",
    "Process",
    "environment_unusable",
    "model_fault",
]


@dataclass(frozen=True)
class CommandOutput:
    """A chunk of a command's combined stdout and stderr."""

    data: bytes
    # Its sequence number in the command's or process's output, when known
    # (not part of equality: two chunks with the same bytes are the same output).
    seq: int | None = field(default=None, compare=False)


@dataclass(frozen=True)
class CommandExit:
    """How a command ended; always the last event of its stream."""

    exit_code: int
    timed_out: bool
    duration_ms: int


CommandEvent = CommandOutput | CommandExit


@dataclass(frozen=True)
class Process:
    """A background process in the environment."""

    process_id: str
    name: str
    running: bool
    # The exit status once it has exited.
    exit: CommandExit | None
    # The sequence number its next output chunk will get.
    next_seq: int
    # Whether its stdin is a pipe still open for ``write_stdin``.
    stdin_open: bool = False


class EnvironmentPort(Protocol):
    """The environment of one session, for the tools of its turns."""

    def exec(self, shell: str, *, cwd: str, timeout_ms: int, key: str = "") -> AsyncGenerator[CommandEvent, None]:
        """Runs ``sh -c shell``: output chunks, then one CommandExit. Closing
        the iterator early (``contextlib.aclosing``) kills the command. A
        command with a ``key`` runs on in the sandbox if this process dies,
        and ``reattach(key)`` finds it again."""
        ...

    async def reattach(self, key: str) -> AsyncGenerator[CommandEvent, None] | None:
        """The whole output of the command ``exec`` started with ``key``
        (from its first chunk), then its CommandExit; None when no such
        command was ever started. Closing the iterator early kills it."""
        ...

    async def read_file(self, path: str, *, limit: int) -> tuple[bytes, bool]:
        """The file's first ``limit`` bytes and whether it was longer."""
        ...

    async def write_file(self, path: str, data: bytes) -> None:
        """Creates or replaces the file with ``data``."""
        ...

    async def remove_file(self, path: str) -> None:
        """Removes the file (a symlink itself, not its target)."""
        ...

    async def start_process(
        self, shell: str, *, name: str, cwd: str, keepalive: bool, stdin: bool = False
    ) -> Process:
        """Starts ``sh -c shell`` in the background; it outlives the turn.
        A ``keepalive`` process keeps the sandbox from pausing while idle.
        With ``stdin`` its stdin is a pipe for ``write_stdin``; otherwise it
        reads /dev/null."""
        ...

    async def write_stdin(self, process_id: str, data: bytes, *, close: bool) -> Process:
        """Writes ``data`` to the stdin of a process started with ``stdin``,
        then closes it (the process reads end of file) when ``close``."""
        ...

    def process_output(self, process_id: str, *, from_seq: int) -> AsyncGenerator[CommandEvent, None]:
        """The process's output from sequence number ``from_seq``, then one
        CommandExit once it has exited. Closing the iterator leaves the
        process running."""
        ...

    async def kill_process(self, process_id: str) -> Process | None:
        """Kills the process and its whole tree; None when it is unknown."""
        ...

    async def list_processes(self) -> list[Process]:
        """The environment's background processes, running and exited."""
        ...


def environment_unusable(error: BerthError) -> bool:
    """Whether a failed environment call means the environment itself cannot
    be used (the turn fails with sandbox_error), rather than that the tool's
    input was wrong (the model is told and goes on)."""
    return isinstance(error, (Unavailable, FailedPrecondition)) or type(error) is BerthError


def model_fault(error: BerthError) -> bool:
    """Whether a failed call on a file or process the model named is the
    model's to handle (it is told and goes on): every error that does not
    make the environment unusable, and a plain FailedPrecondition, which the
    sandbox raises for a directory where a file was expected or a closed
    stdin."""
    return type(error) is FailedPrecondition or not environment_unusable(error)
