"""Dormancy: an idle daemon that costs almost nothing.

An idle sandboxd holds asyncio and every op's module, about 10 MiB of heap
that nothing inside the sandbox can share. When it has been idle for
``--dormant-after`` seconds (no request in flight, no child process, no MCP
broker, relay or tunnel), the daemon replaces itself (``execv``, so it stays
PID 1 and keeps every descriptor) with this module: a bare interpreter that
imports nothing but ``os``, ``sys`` and ``select``, waiting for the listening
socket or one of the open connections to become readable. It then
``execv``s the full daemon back with ``--resume-fds``, which adopts the
socket and the connections as they were (already past their ``hello``), so
the client only sees its next request take the daemon's start-up time.

A daemon started with ``--start-dormant`` is dormant from the start: it binds
its socket (``listen``) and waits, so a sandbox nobody uses yet never pays for
the full daemon, and creating many is cheaper.

Nothing crosses this state but descriptors: the daemon goes dormant only
when no frame is half read or half written, and the environment is read
again from ``--env-file`` on waking, as ``env.reload`` would.

Keep this module's imports to the three above: each further one is paid by
every dormant sandbox.
"""

from __future__ import annotations

import os
import select
import sys

DORMANT_FLAG = "--dormant"
START_DORMANT_FLAG = "--start-dormant"
RESUME_FLAG = "--resume-fds"


DORMANT_AFTER_FLAG = "--dormant-after"

# How the archive is run: ``python3 -I -S -c BOOT <archive> args...``
# imports the package straight from the archive. ``python3 <archive>`` would
# go through runpy (and what it imports), about 4 ms more on every start and
# every wake. -I keeps the working directory (the sandbox's workspace) and
# PYTHON* variables out of the import path.
BOOT = (
    "import sys; sys.argv[0] = sys.argv.pop(1); sys.path.insert(0, sys.argv[0]); "
    "from sandboxd.__main__ import main; sys.exit(main())"
)


def launch(python: str, archive: str) -> list[str]:
    """The command line that runs the daemon in ``archive`` with ``python``;
    the daemon's own arguments follow it."""
    return [python, "-I", "-S", "-c", BOOT, archive]


def with_option(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with every ``flag <value>`` pair replaced by one at the end."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        else:
            out.append(arg)
    return out + [flag, value]


def dormant_argv(fds: list[int], dormant_after_s: float) -> list[str]:
    """The command line that makes this (full) daemon dormant, keeping
    ``fds``; on waking it becomes this daemon again, with the same idle
    period (which ``env.reload`` may have changed since it started)."""
    original = [sys.executable] + list(getattr(sys, "orig_argv", [""] + sys.argv)[1:])
    original = with_option(original, DORMANT_AFTER_FLAG, repr(dormant_after_s))
    return launch(sys.executable, sys.argv[0]) + [DORMANT_FLAG, ",".join(str(fd) for fd in fds)] + original


def start(argv: list[str]) -> None:
    """Starts dormant: binds the socket of the command line ``argv`` (the
    daemon's own, ``--start-dormant`` in it) and waits for its first
    connection to become the daemon; it never returns."""
    from .listen import bind_unix_socket

    command = [sys.executable] + list(getattr(sys, "orig_argv", [""] + sys.argv)[1:])
    command = [arg for arg in command if arg != START_DORMANT_FLAG]
    fd = bind_unix_socket(argv[argv.index("--socket") + 1])
    os.set_inheritable(fd, True)
    wait([DORMANT_FLAG, str(fd)] + command)


def wait(argv: list[str]) -> None:
    """``argv`` is ``[--dormant, fds, original command line...]``: waits
    until a descriptor is readable (or hung up), then becomes the daemon;
    it never returns."""
    fds = [int(fd) for fd in argv[1].split(",") if fd]
    command = argv[2:]
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN | select.POLLPRI)
    while True:
        try:
            if poller.poll():
                break
        except InterruptedError:
            continue
    os.execv(command[0], with_option(command, RESUME_FLAG, ",".join(str(fd) for fd in fds)))


if __name__ == "__main__":
    wait(sys.argv[1:])
