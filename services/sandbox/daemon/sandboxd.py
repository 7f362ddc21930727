#!/usr/bin/env python3
"""sandboxd: the in-sandbox daemon of Berth.

Standard library only and compatible with Python 3.9, because it runs inside
arbitrary images: it is bind-mounted read-only and started as the sandbox's
first process, e.g.

    python3 /opt/berth/sandboxd.py --socket /run/berth/sandboxd.sock \
        --workspace /workspace --state-dir /run/berth/state

Wire protocol (version 1)
-------------------------
Every frame is a 4-byte big-endian unsigned length followed by that many bytes
of UTF-8 JSON (an object). Frames larger than ``MAX_FRAME_BYTES`` (96 MiB) are
a protocol error and close the connection; file writes carry at most
``MAX_WRITE_BYTES`` (64 MiB) of data, which base64 inflates to about 86 MiB.
Binary payloads travel base64-encoded in ``data_b64`` (``stdin_b64`` for exec).

The client opens with ``{"op": "hello", "v": 1}``. The daemon answers
``{"ok": true, "v": 1, "pid", "workspace", "root", "isolation"}`` or, for an
unsupported version, ``{"ok": false, "error": {...}}`` and closes.

Requests are ``{"id": <int>, "op": ..., ...}``. Every response frame carries
the request's ``id``; the last one has ``"final": true``. Requests run
concurrently, so a slow one never holds up another on the same connection.
``{"op": "cancel", "target": <id>}`` (``id`` optional) cancels a request; for
``exec`` that SIGKILLs the command's whole process tree, as does the client
connection closing. Failures are final frames
``{"id", "final": true, "error": {"code", "message"}}`` with ``code`` one of
``not_found``, ``invalid_argument``, ``permission_denied``,
``failed_precondition``, ``internal``; an error may add ``reason`` (a finer
cause callers act on, e.g. ``mcp_server_dead``) and ``param`` (the field).

Output is streamed as ``{"type": "chunk", "stream": "stdout"|"stderr",
"seq": n, "data_b64"}``; seq numbers are shared by both streams of one command
and count up from 0. Commands end with ``{"type": "exit", "exit_code",
"timed_out", "duration_ms"}``. ``exit_code`` is negative (``-signal``) for a
command killed by a signal, and 124 for an exec killed by its ``timeout_s``.

An exec's leftover background children keep running after it returns (their
later output is dropped); use ``process.start`` for work that should outlive a
request. Background processes start in their own session, outlive the
connection that started them, and keep their exit code after exiting;
``keepalive`` is recorded for the service (it keeps the sandbox from idle
pause) and never makes the daemon restart a process. ``process.kill``
signals the whole tree.

Operations: ``exec``, ``process.start``, ``process.attach``, ``process.list``,
``process.wait``, ``process.kill``, ``file.write``, ``file.read``,
``file.list``, ``file.stat``, ``file.mkdir``, ``file.remove``, ``mcp.start``,
``mcp.request``, ``mcp.notify``, ``mcp.subscribe``, ``mcp.list``,
``mcp.stop``, ``mcp.close_upstream``, ``env.reload``, ``egress.relay``,
``ping``, ``shutdown``. See the ``_op_*`` methods for their fields.

``env.reload`` re-reads the sandbox's environment (``--env-file``, then
``--env``) for commands started from then on; running commands and MCP
servers keep theirs. A container started before its sandbox was known (the
docker backend's warm pool) learns the sandbox's variables this way. A
malformed file fails the request and keeps the old environment.

``egress.relay {port, socket}`` listens on ``127.0.0.1:port`` (0 picks a
port) and relays every connection, byte for byte, to the unix socket
``socket``: a ``restricted`` sandbox has no network of its own, and that
socket is its egress proxy, served by the Sandbox service from outside.
Answers ``{"port"}``; asking again for the same socket returns the running
relay. When the socket is missing (the service restarts) a connection is
closed at once.

MCP brokers
-----------
One broker per ``label`` per sandbox multiplexes every client of an
environment-origin MCP server onto one upstream: a stdio server process or
a streamable HTTP endpoint reached from the sandbox's network.

``mcp.start {label, transport}`` with ``transport`` either
``{"type": "stdio", "command", "args", "cwd", "env", "env_vars"}`` or
``{"type": "http", "server_url", "headers"}``. The first start of a label
creates its broker; every later start returns that broker, running or dead,
without looking at its own transport, and a dead broker is never restarted.
The answer is the broker (see ``mcp.list``) plus ``created``. A stdio
server runs in its own process group with ``PATH``, ``HOME`` and ``LANG``,
the variables named in ``env_vars`` taken from the sandbox's environment
(the daemon's own plus ``--env-file``/``--env``), then ``env``; it keeps
that launch-time environment for its whole life.

The client side is one-shot: every ``mcp.request {label, message}`` is its
own client. The broker rewrites the request's id to a broker-wide integer
and back, so concurrent callers may reuse ids; the final frame carries the
response as ``message``. ``mcp.notify {label, message}`` sends a
notification, or the answer to a server request. ``mcp.subscribe {label}``
streams ``{"type": "subscribed"}`` once registered, then
``{"type": "message", "message"}`` for every server notification (to all
subscribers) and server request (to the oldest subscriber only, which
answers it with ``mcp.notify``; with none, the broker answers ``ping`` and
fails other server requests with -32601); it ends when the broker dies.
The first ``initialize`` goes upstream and its result is cached; later
ones are answered from the cache with their own id, and a
``notifications/initialized`` is forwarded only once per upstream
handshake. A client ``notifications/cancelled`` is dropped (its id is
ambiguous); cancelling the ``mcp.request`` itself sends the server a
cancellation for the rewritten id.

``mcp.list`` returns ``{"brokers": [{label, transport, state: "running" |
"dead", pid, started_at, exit_code, clients, in_flight, stderr_tail}]}``.
``mcp.stop {label}`` kills a stdio server's process tree (or ends an HTTP
broker's upstream session) and leaves the broker dead. Requests to a dead
broker fail with ``failed_precondition`` and reason ``mcp_server_dead``;
an unknown label is ``not_found``. ``mcp.close_upstream {label}`` ends an
HTTP broker's upstream session with DELETE (``{"closed": bool}``; a no-op
for stdio). That affects every peer of the label, but transparently: the
next request re-runs the cached handshake upstream on a fresh session, as
it also does when the server answers 404 for an expired session. Upstream
HTTP failures answer the request with a JSON-RPC error (code -32000,
``data.http_status``) rather than failing the operation.

Paths
-----
File paths are ``/workspace/...`` or relative to the workspace; ``/workspace``
maps to the ``--workspace`` root, which is a host directory when unconfined.
A path whose ``..`` components climb out of the root is ``invalid_argument``;
a path that leaves the root through a symlink is ``permission_denied``.
Inside a bubblewrap or container sandbox this confinement defines the API
rather than a security boundary: the sandbox's own processes can already
reach everything the daemon can.

Process output log
------------------
Each background process appends its output to
``<state-dir>/procs/<process_id>.log`` as records of a 13-byte header
(big-endian u64 seq, u8 stream: 1 stdout / 2 stderr, u32 length) followed by
the data, so attaching can replay chunks that have left the in-memory ring.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import bisect
import collections
import errno
import functools
import itertools
import json
import os
import posixpath
import secrets
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from typing import Any, Awaitable, Callable, Deque, Dict, Iterable, List, Optional, Set, Tuple

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 96 * 1024 * 1024
MAX_WRITE_BYTES = 64 * 1024 * 1024
MAX_READ_CHUNK = 1024 * 1024
PIPE_READ_SIZE = 64 * 1024
DEFAULT_RING_BYTES = 1024 * 1024
MAX_LIST_ENTRIES = 100000
MAX_EXITED_PROCESSES = 1024
VIRTUAL_ROOT = "/workspace"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
MARKER_ENV = "BERTH_PROCESS_ID"
EXEC_TIMEOUT_EXIT_CODE = 124
# After a command's main process exits, keep reading its pipes while they
# still deliver data; a leftover background child holding them open must not
# keep the exec open forever.
OUTPUT_IDLE_GRACE_S = 0.2
LOG_INDEX_EVERY = 64
MCP_MAX_LABEL = 128
MCP_MAX_LINE_BYTES = 32 * 1024 * 1024
MCP_STDERR_TAIL_BYTES = 4096
MCP_SUBSCRIBER_QUEUE = 1024
# Idle bound of one upstream HTTP read (a tool call streaming nothing for
# this long fails); each upstream POST runs on its own thread.
MCP_HTTP_TIMEOUT_S = 300.0
# JSON-RPC error code of a request the HTTP upstream never answered.
MCP_UPSTREAM_ERROR = -32000

_LENGTH = struct.Struct(">I")
_LOG_RECORD = struct.Struct(">QBI")
_STREAM_CODES = {"stdout": 1, "stderr": 2}
_STREAM_NAMES = {1: "stdout", 2: "stderr"}

Json = Dict[str, Any]


def _log(message: str) -> None:
    sys.stderr.write("sandboxd: %s\n" % message)
    sys.stderr.flush()


class OpError(Exception):
    """A failed request. ``reason`` refines ``code`` for callers that act on
    it (e.g. ``mcp_server_dead``); ``param`` names the offending field."""

    def __init__(self, code: str, message: str, reason: Optional[str] = None, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason
        self.param = param

    def frame(self) -> Json:
        error: Json = {"code": self.code, "message": self.message}
        if self.reason is not None:
            error["reason"] = self.reason
        if self.param is not None:
            error["param"] = self.param
        return error


class ProtocolError(Exception):
    pass


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(value: Any, field: str) -> bytes:
    if not isinstance(value, str):
        raise OpError("invalid_argument", "%s must be a base64 string" % field)
    try:
        return base64.b64decode(value, validate=True)
    except ValueError:
        raise OpError("invalid_argument", "%s is not valid base64" % field) from None


def encode_frame(obj: Json) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode("utf-8")
    return _LENGTH.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> Optional[Json]:
    """Returns None on a clean end of stream between frames."""
    try:
        header = await reader.readexactly(_LENGTH.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ProtocolError("truncated frame header") from None
    (length,) = _LENGTH.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ProtocolError("frame of %d bytes exceeds the %d byte limit" % (length, MAX_FRAME_BYTES))
    try:
        body = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise ProtocolError("truncated frame") from None
    try:
        obj = json.loads(body.decode("utf-8"))
    except ValueError:
        raise ProtocolError("frame is not UTF-8 JSON") from None
    if not isinstance(obj, dict):
        raise ProtocolError("frame is not a JSON object")
    return obj


# ---------------------------------------------------------------- request fields


def _opt_str(req: Json, key: str) -> Optional[str]:
    value = req.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise OpError("invalid_argument", "%s must be a string" % key)
    return value


def _req_str(req: Json, key: str) -> str:
    value = _opt_str(req, key)
    if value is None or value == "":
        raise OpError("invalid_argument", "%s is required" % key)
    return value


def _opt_bool(req: Json, key: str, default: bool) -> bool:
    value = req.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise OpError("invalid_argument", "%s must be a boolean" % key)
    return value


def _opt_int(req: Json, key: str, default: Optional[int]) -> Optional[int]:
    value = req.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise OpError("invalid_argument", "%s must be an integer" % key)
    return value


def _opt_positive_float(req: Json, key: str) -> Optional[float]:
    value = req.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise OpError("invalid_argument", "%s must be a positive number" % key)
    return float(value)


def _opt_env(req: Json) -> Dict[str, str]:
    value = req.get("env")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise OpError("invalid_argument", "env must be an object")
    env: Dict[str, str] = {}
    for key, item in value.items():
        if not isinstance(item, str) or not key or "=" in key or "\0" in key or "\0" in item:
            raise OpError("invalid_argument", "env entries must be NAME: string")
        env[key] = item
    return env


def _command_argv(req: Json) -> List[str]:
    argv = req.get("argv")
    shell = req.get("shell")
    if (argv is None) == (shell is None):
        raise OpError("invalid_argument", "exactly one of argv and shell is required")
    if shell is not None:
        if not isinstance(shell, str):
            raise OpError("invalid_argument", "shell must be a string")
        return ["/bin/sh", "-c", shell]
    if (
        not isinstance(argv, list)
        or not argv
        or not all(isinstance(a, str) and "\0" not in a for a in argv)
        or not argv[0]
    ):
        raise OpError("invalid_argument", "argv must be a non-empty list of strings")
    return list(argv)


def _parse_signal(value: Any) -> int:
    if value is None:
        return int(signal.SIGKILL)
    if isinstance(value, bool):
        raise OpError("invalid_argument", "signal must be a number or a name")
    if isinstance(value, int):
        if value <= 0 or value >= signal.NSIG:
            raise OpError("invalid_argument", "unknown signal %d" % value)
        return value
    if isinstance(value, str):
        name = value.upper()
        if not name.startswith("SIG"):
            name = "SIG" + name
        sig = getattr(signal.Signals, name, None)
        if sig is None:
            raise OpError("invalid_argument", "unknown signal %s" % value)
        return int(sig)
    raise OpError("invalid_argument", "signal must be a number or a name")


def _os_error(exc: OSError, path: str) -> OpError:
    if isinstance(exc, FileNotFoundError):
        return OpError("not_found", "%s does not exist" % path)
    if isinstance(exc, PermissionError):
        return OpError("permission_denied", "permission denied: %s" % path)
    if isinstance(exc, FileExistsError):
        return OpError("failed_precondition", "%s already exists" % path)
    if isinstance(exc, IsADirectoryError):
        return OpError("failed_precondition", "%s is a directory" % path)
    if isinstance(exc, NotADirectoryError):
        return OpError("failed_precondition", "a component of %s is not a directory" % path)
    if exc.errno == errno.ENOTEMPTY:
        return OpError("failed_precondition", "%s is not empty" % path)
    if exc.errno == errno.ELOOP:
        return OpError("permission_denied", "%s is a symlink" % path)
    if exc.errno == errno.ENOSPC:
        return OpError("failed_precondition", "no space left writing %s" % path)
    return OpError("internal", "%s: %s" % (path, exc.strerror or exc))


# ---------------------------------------------------------------- /proc scanning


class _ProcInfo:
    __slots__ = ("pid", "ppid", "pgrp", "session", "state")

    def __init__(self, pid: int, ppid: int, pgrp: int, session: int, state: str) -> None:
        self.pid = pid
        self.ppid = ppid
        self.pgrp = pgrp
        self.session = session
        self.state = state


def _proc_table() -> Dict[int, _ProcInfo]:
    table: Dict[int, _ProcInfo] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as handle:
                data = handle.read().decode("ascii", "replace")
        except OSError:
            continue
        # The command name may itself contain ")", so split at the last one.
        fields = data[data.rfind(")") + 2 :].split()
        if len(fields) < 4:
            continue
        pid = int(name)
        table[pid] = _ProcInfo(pid, int(fields[1]), int(fields[2]), int(fields[3]), fields[0])
    return table


def _has_marker(pid: int, needle: bytes) -> bool:
    try:
        with open("/proc/%d/environ" % pid, "rb") as handle:
            data = handle.read()
    except OSError:
        return False
    return needle in b"\0" + data


def _tree_members(root_pid: Optional[int], group: Optional[int], marker: Optional[str]) -> Set[int]:
    """Live processes that belong to a command: its descendants, its process
    group and session, and anything still carrying its marker variable (which
    finds children that escaped with setsid and were reparented)."""
    table = _proc_table()
    members: Set[int] = set()
    if root_pid is not None and root_pid in table:
        members.add(root_pid)
        children: Dict[int, List[int]] = {}
        for info in table.values():
            children.setdefault(info.ppid, []).append(info.pid)
        stack = [root_pid]
        while stack:
            for child in children.get(stack.pop(), ()):
                if child not in members:
                    members.add(child)
                    stack.append(child)
    if group is not None:
        members.update(p.pid for p in table.values() if p.pgrp == group or p.session == group)
    if marker is not None:
        needle = ("\0%s=%s\0" % (MARKER_ENV, marker)).encode()
        members.update(pid for pid in table if pid not in members and _has_marker(pid, needle))
    members.discard(os.getpid())
    return {pid for pid in members if table[pid].state not in ("Z", "X")}


# ---------------------------------------------------------------- child processes


class Child:
    """A process the daemon spawned; its exit status arrives through the reaper."""

    def __init__(self, popen: "subprocess.Popen[bytes]", marker: str, exited: "asyncio.Future[int]") -> None:
        self.popen = popen
        self.pid = popen.pid
        self.marker = marker
        self.exited = exited
        self.started = time.monotonic()
        self.ended: Optional[float] = None

    @property
    def running(self) -> bool:
        return not self.exited.done()

    def kill_tree(self, sig: int) -> int:
        """Signals every live member of the command's tree; returns how many.
        SIGKILL rescans until nothing is left, since a member may fork between
        the scan and the signal."""
        total = 0
        for _ in range(8):
            root = self.pid if self.running else None
            members = _tree_members(root, self.pid, self.marker)
            if not members:
                break
            for pid in members:
                try:
                    os.kill(pid, sig)
                    total += 1
                except ProcessLookupError:
                    pass
            if sig != signal.SIGKILL:
                break
        return total


COMMAND_OOM_SCORE_ADJ = 500


def _raise_oom_score(pid: int) -> None:
    """Commands are the OOM killer's first choice (the daemon keeps 0), so a
    command that overruns the sandbox's memory limit is the one killed and
    the sandbox goes on. Raising a score needs no privilege (lowering one
    does, and some hosts refuse it even to root)."""
    try:
        with open("/proc/%d/oom_score_adj" % pid, "w") as f:
            f.write(str(COMMAND_OOM_SCORE_ADJ))
    except OSError:
        pass


class Reaper:
    """Owns every waitpid in the daemon. As PID 1 it also reaps orphans; for
    its own children it records the status instead of losing it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._children: Dict[int, Child] = {}
        loop.add_signal_handler(signal.SIGCHLD, self.reap)

    def spawn(self, argv: List[str], cwd: str, env: Dict[str, str], marker: str, stdin_pipe: bool) -> Child:
        popen = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            close_fds=True,
        )
        _raise_oom_score(popen.pid)
        child = Child(popen, marker, self._loop.create_future())
        self._children[popen.pid] = child
        return child

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            child = self._children.pop(pid, None)
            if child is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            # Popen must never waitpid a pid we already reaped: it may be reused.
            child.popen.returncode = code
            child.ended = time.monotonic()
            if not child.exited.done():
                child.exited.set_result(code)

    def live_children(self) -> List[Child]:
        return list(self._children.values())


def _consume_result(task: "asyncio.Task[Any]") -> None:
    if not task.cancelled():
        task.exception()


async def _pump_pipe(pipe: Any, on_data: Callable[[bytes], Awaitable[None]], progress: List[int]) -> None:
    """Reads a child's pipe until EOF; awaiting ``on_data`` is the
    backpressure that keeps a fast writer from outrunning a slow reader."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=4 * PIPE_READ_SIZE)
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    try:
        while True:
            data = await reader.read(PIPE_READ_SIZE)
            if not data:
                return
            progress[0] += len(data)
            await on_data(data)
    finally:
        transport.close()


async def _feed_stdin(pipe: Any, data: bytes) -> None:
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_write_pipe(asyncio.Protocol, pipe)
    # The transport buffers what the pipe cannot take yet and closes the pipe
    # once the buffer is flushed; a child that exits without reading is fine.
    transport.write(data)
    transport.close()


async def _drain_after_exit(pumps: List["asyncio.Task[None]"], progress: List[int]) -> None:
    """Waits for the output pumps while they keep making progress, then
    abandons pipes that only a leftover background child holds open."""
    pending = [p for p in pumps if not p.done()]
    last = -1
    while pending and progress[0] != last:
        last = progress[0]
        _, still = await asyncio.wait(pending, timeout=OUTPUT_IDLE_GRACE_S)
        pending = list(still)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    for task in pumps:
        if not task.cancelled():
            exc = task.exception()
            if exc is not None:
                raise exc


# ---------------------------------------------------------------- background processes


class ManagedProcess:
    def __init__(
        self,
        process_id: str,
        name: str,
        child: Child,
        keepalive: bool,
        log_path: str,
        ring_bytes: int,
    ) -> None:
        self.process_id = process_id
        self.name = name
        self.child = child
        self.keepalive = keepalive
        self.started_at = time.time()
        self.log_path = log_path
        self.ring_limit = ring_bytes
        self.ring: Deque[Tuple[int, int, bytes]] = collections.deque()
        self.ring_size = 0
        self.ring_first_seq = 0
        self.next_seq = 0
        self.exit_code: Optional[int] = None
        self.duration_ms = 0
        self.finished = asyncio.Event()
        self.supervisor: Optional["asyncio.Task[None]"] = None
        self._changed = asyncio.Event()
        self._index: List[Tuple[int, int]] = []
        self._log_offset = 0
        self._log_fd: Optional[int] = os.open(
            log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC, 0o600
        )

    @property
    def running(self) -> bool:
        return self.exit_code is None

    def changed(self) -> asyncio.Event:
        return self._changed

    def _notify(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    def append(self, stream: int, data: bytes) -> None:
        seq = self.next_seq
        self.next_seq += 1
        if self._log_fd is not None:
            if seq % LOG_INDEX_EVERY == 0:
                self._index.append((seq, self._log_offset))
            record = _LOG_RECORD.pack(seq, stream, len(data)) + data
            try:
                os.write(self._log_fd, record)
                self._log_offset += len(record)
            except OSError as exc:
                # A full disk must not kill the process; the ring still has it.
                _log("log write for %s failed: %s" % (self.process_id, exc))
                os.close(self._log_fd)
                self._log_fd = None
        self.ring.append((seq, stream, data))
        self.ring_size += len(data)
        while self.ring_size > self.ring_limit and len(self.ring) > 1:
            _, _, old = self.ring.popleft()
            self.ring_size -= len(old)
            self.ring_first_seq += 1
        self._notify()

    def finish(self, exit_code: int) -> None:
        self.exit_code = exit_code
        self.duration_ms = int(((self.child.ended or time.monotonic()) - self.child.started) * 1000)
        self.finished.set()
        self._notify()

    def close_log(self) -> None:
        if self._log_fd is not None:
            os.close(self._log_fd)
            self._log_fd = None

    def from_ring(self, seq: int, max_bytes: int) -> List[Tuple[int, int, bytes]]:
        out: List[Tuple[int, int, bytes]] = []
        size = 0
        for record in itertools.islice(self.ring, seq - self.ring_first_seq, None):
            out.append(record)
            size += len(record[2])
            if size >= max_bytes:
                break
        return out

    def from_log(self, seq: int, before_seq: int, max_bytes: int) -> List[Tuple[int, int, bytes]]:
        """Chunks seq..before_seq-1 read back from the on-disk log."""
        pos = bisect.bisect_right(self._index, (seq, 1 << 62)) - 1
        offset = self._index[pos][1] if pos >= 0 else 0
        out: List[Tuple[int, int, bytes]] = []
        size = 0
        try:
            fd = os.open(self.log_path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return out
        try:
            while size < max_bytes:
                header = os.pread(fd, _LOG_RECORD.size, offset)
                if len(header) < _LOG_RECORD.size:
                    break
                rec_seq, stream, length = _LOG_RECORD.unpack(header)
                if rec_seq >= before_seq:
                    break
                if rec_seq >= seq:
                    data = os.pread(fd, length, offset + _LOG_RECORD.size)
                    out.append((rec_seq, stream, data))
                    size += len(data)
                offset += _LOG_RECORD.size + length
        finally:
            os.close(fd)
        return out

    def describe(self) -> Json:
        return {
            "process_id": self.process_id,
            "name": self.name,
            "pid": self.child.pid,
            "running": self.running,
            "exit_code": self.exit_code,
            "keepalive": self.keepalive,
            "started_at": self.started_at,
            "next_seq": self.next_seq,
        }

    def exit_frame(self) -> Json:
        return {
            "type": "exit",
            "exit_code": self.exit_code,
            "timed_out": False,
            "duration_ms": self.duration_ms,
        }


# ---------------------------------------------------------------- MCP brokers


def _jsonrpc_id(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def _is_request(msg: Json) -> bool:
    return isinstance(msg.get("method"), str) and _jsonrpc_id(msg.get("id"))


def _is_notification(msg: Json) -> bool:
    return isinstance(msg.get("method"), str) and "id" not in msg


def _is_response(msg: Json) -> bool:
    return "method" not in msg and _jsonrpc_id(msg.get("id")) and ("result" in msg or "error" in msg)


def _jsonrpc_error(msg_id: Any, code: int, message: str, data: Optional[Json] = None) -> Json:
    error: Json = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return {"jsonrpc": "2.0", "id": msg_id, "error": error}


def _mcp_label(req: Json) -> str:
    label = req.get("label")
    if not isinstance(label, str) or not 0 < len(label) <= MCP_MAX_LABEL or any(c.isspace() or not c.isprintable() for c in label):
        raise OpError("invalid_argument", "label must be 1-%d printable characters without spaces" % MCP_MAX_LABEL, param="label")
    return label


def _mcp_message(req: Json) -> Json:
    message = req.get("message")
    if not isinstance(message, dict):
        raise OpError("invalid_argument", "message must be one JSON-RPC message object", param="message")
    return message


def _str_list(value: Any, field: str) -> List[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) and "\0" not in v for v in value):
        raise OpError("invalid_argument", "%s must be a list of strings" % field, param=field)
    return list(value)


def _str_dict(value: Any, field: str) -> Dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise OpError("invalid_argument", "%s must be an object of strings" % field, param=field)
    return dict(value)


def _in_thread(fn: Callable[..., Any], *args: Any) -> "asyncio.Future[Any]":
    """Runs blocking ``fn`` on a daemon thread: unlike an executor's workers,
    a thread stuck on a slow upstream never holds up the daemon's exit."""
    loop = asyncio.get_running_loop()
    future: "asyncio.Future[Any]" = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

    def run() -> None:
        try:
            result = (True, fn(*args))
        except BaseException as exc:  # handed to the awaiting coroutine
            result = (False, exc)
        try:
            loop.call_soon_threadsafe(settle, *result)
        except RuntimeError:
            pass  # the loop closed while the upstream call ran

    threading.Thread(target=run, name="mcp-http", daemon=True).start()
    return future


class McpSubscriber:
    """One ``mcp.subscribe`` stream: a bounded queue of server messages."""

    def __init__(self) -> None:
        self.queue: Deque[Json] = collections.deque()
        self.wakeup = asyncio.Event()
        self.closed = False
        self.dropped = 0
        # Server requests routed to this subscriber and not yet answered.
        self.owes: Set[Any] = set()

    def put(self, msg: Json) -> None:
        if len(self.queue) >= MCP_SUBSCRIBER_QUEUE:
            # A subscriber that stopped reading loses the oldest messages
            # rather than growing the daemon without bound.
            self.queue.popleft()
            self.dropped += 1
        self.queue.append(msg)
        self.wakeup.set()

    def close(self) -> None:
        self.closed = True
        self.wakeup.set()


class McpBroker:
    """One MCP server shared by every client of a label in this sandbox.

    Each ``mcp.request`` is its own client: its id is rewritten to a
    broker-wide integer on the way up and restored on the way back, so any
    number of callers can reuse the same ids concurrently. The first
    successful ``initialize`` is forwarded and its result cached; later ones
    are answered from the cache with their own id, and only the first
    ``notifications/initialized`` after an upstream handshake is forwarded.
    Server notifications go to every subscriber; a server request goes to
    the oldest subscriber, which answers it with ``mcp.notify``. With no
    subscriber the broker answers ``ping`` itself and fails any other server
    request at once (-32601), so the server never waits on nobody.
    """

    transport = ""

    def __init__(self, label: str) -> None:
        self.label = label
        self.started_at = time.time()
        self.exit_code: Optional[int] = None
        self.dead = False
        self.dead_reason = ""
        self.subscribers: List[McpSubscriber] = []
        self.done = asyncio.Event()
        self._ids = itertools.count(1)
        self._pending: Dict[int, "asyncio.Future[Json]"] = {}
        self._init_lock = asyncio.Lock()
        self._init_result: Optional[Json] = None
        self._init_params: Any = None
        self._initialized_sent = False
        self._routed: Dict[Any, McpSubscriber] = {}
        self._background: Set["asyncio.Task[Any]"] = set()

    # ------------------------------------------------------------ transport hooks

    async def _send(self, msg: Json) -> None:
        """Delivers one message upstream; a request's answer arrives through
        ``_from_upstream``."""
        raise NotImplementedError

    async def _send_request(self, msg: Json, upstream_id: int) -> None:
        await self._send(msg)

    def pid(self) -> Optional[int]:
        return None

    def kill(self) -> None:
        """Synchronous last resort for daemon shutdown."""

    async def stop(self) -> None:
        raise NotImplementedError

    async def close_upstream(self) -> bool:
        return False

    def stderr_tail(self) -> str:
        return ""

    # ------------------------------------------------------------ state

    @property
    def state(self) -> str:
        return "dead" if self.dead else "running"

    def describe(self) -> Json:
        return {
            "label": self.label,
            "transport": self.transport,
            "state": self.state,
            "pid": self.pid(),
            "started_at": self.started_at,
            "exit_code": self.exit_code,
            "clients": len(self.subscribers) + len(self._pending),
            "in_flight": len(self._pending),
            "stderr_tail": self.stderr_tail(),
        }

    def dead_error(self) -> OpError:
        detail = self.dead_reason or ("exit code %s" % self.exit_code)
        return OpError(
            "failed_precondition",
            "MCP server %s is dead (%s); it is not restarted" % (self.label, detail),
            reason="mcp_server_dead",
            param="label",
        )

    def mark_dead(self, exit_code: Optional[int], reason: str) -> None:
        if self.dead:
            return
        self.dead = True
        self.exit_code = exit_code
        self.dead_reason = reason
        error = self.dead_error()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        for sub in self.subscribers:
            sub.close()
        self.done.set()

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_consume_result)

    # ------------------------------------------------------------ client side

    async def request(self, msg: Json) -> Json:
        if self.dead:
            raise self.dead_error()
        if msg.get("method") == "initialize":
            async with self._init_lock:
                if self._init_result is None:
                    response = await self._forward(msg)
                    result = response.get("result")
                    if isinstance(result, dict):
                        self._init_result = result
                        self._init_params = msg.get("params")
                        self._initialized_sent = False
                        self._handshake_done(result)
                    return response
            return {"jsonrpc": "2.0", "id": msg["id"], "result": json.loads(json.dumps(self._init_result))}
        return await self._forward(msg)

    def _handshake_done(self, result: Json) -> None:
        """Called once the first upstream handshake succeeded."""

    async def _forward(self, msg: Json) -> Json:
        upstream_id = next(self._ids)
        future: "asyncio.Future[Json]" = asyncio.get_running_loop().create_future()
        self._pending[upstream_id] = future
        upstream = dict(msg)
        upstream["id"] = upstream_id
        try:
            await self._send_request(upstream, upstream_id)
            response = await future
        except asyncio.CancelledError:
            if not self.dead and msg.get("method") != "initialize":
                cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": upstream_id, "reason": "the client went away"}}
                self._spawn(self._send_quietly(cancel))
            raise
        finally:
            self._pending.pop(upstream_id, None)
        out = dict(response)
        out["id"] = msg["id"]
        return out

    async def _send_quietly(self, msg: Json) -> None:
        try:
            await self._send(msg)
        except OpError:
            pass

    async def notify(self, msg: Json) -> bool:
        """Forwards a client notification, or a client's answer to a server
        request; returns whether anything went upstream."""
        if self.dead:
            raise self.dead_error()
        method = msg.get("method")
        if method == "notifications/initialized":
            if self._initialized_sent:
                return False
            self._initialized_sent = True
        elif method == "notifications/cancelled":
            # Its requestId is the client's own id, which is ambiguous across
            # clients; cancelling the mcp.request itself cancels upstream.
            return False
        elif method is None:
            sub = self._routed.pop(msg.get("id"), None)
            if sub is not None:
                sub.owes.discard(msg.get("id"))
        await self._send(msg)
        return True

    def subscribe(self) -> McpSubscriber:
        sub = McpSubscriber()
        if self.dead:
            sub.close()
        else:
            self.subscribers.append(sub)
        return sub

    def unsubscribe(self, sub: McpSubscriber) -> None:
        if sub in self.subscribers:
            self.subscribers.remove(sub)
        for server_id in list(sub.owes):
            # The subscriber left without answering: the server must not wait forever.
            self._routed.pop(server_id, None)
            self._reply_upstream(_jsonrpc_error(server_id, -32603, "the client that received this request went away"))
        sub.owes.clear()

    # ------------------------------------------------------------ server side

    def _from_upstream(self, msg: Any) -> None:
        if isinstance(msg, list):
            for item in msg:
                self._from_upstream(item)
            return
        if not isinstance(msg, dict):
            return
        if isinstance(msg.get("method"), str):
            if "id" in msg:
                self._server_request(msg)
            else:
                for sub in self.subscribers:
                    sub.put(msg)
            return
        upstream_id = msg.get("id")
        future = self._pending.get(upstream_id) if isinstance(upstream_id, int) and not isinstance(upstream_id, bool) else None
        if future is not None and not future.done():
            future.set_result(msg)

    def _server_request(self, msg: Json) -> None:
        for sub in self.subscribers:
            if not sub.closed:
                sub.owes.add(msg["id"])
                self._routed[msg["id"]] = sub
                sub.put(msg)
                return
        if msg.get("method") == "ping":
            self._reply_upstream({"jsonrpc": "2.0", "id": msg["id"], "result": {}})
        else:
            self._reply_upstream(_jsonrpc_error(msg["id"], -32601, "no client is connected to answer %s" % msg.get("method")))

    def _reply_upstream(self, msg: Json) -> None:
        if not self.dead:
            self._spawn(self._send_quietly(msg))


class StdioBroker(McpBroker):
    """A server process speaking newline-delimited JSON-RPC on stdin/stdout."""

    transport = "stdio"

    def __init__(self, label: str, child: Child) -> None:
        super().__init__(label)
        self.child = child
        self._ready = asyncio.Event()
        self._writer: Optional[asyncio.StreamWriter] = None
        self._drain_lock = asyncio.Lock()
        self._stderr: Deque[bytes] = collections.deque()
        self._stderr_size = 0
        self._supervisor = asyncio.ensure_future(self._supervise())
        self._supervisor.add_done_callback(_consume_result)

    def pid(self) -> Optional[int]:
        return self.child.pid

    def stderr_tail(self) -> str:
        return b"".join(self._stderr)[-MCP_STDERR_TAIL_BYTES:].decode("utf-8", "replace")

    async def _supervise(self) -> None:
        loop = asyncio.get_running_loop()
        popen = self.child.popen
        try:
            transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, popen.stdin)
            self._writer = asyncio.StreamWriter(transport, protocol, None, loop)
        except Exception as exc:
            _log("MCP server %s: cannot open its stdin: %r" % (self.label, exc))
            self.child.kill_tree(signal.SIGKILL)
        finally:
            self._ready.set()
        reader = asyncio.ensure_future(self._read_stdout(popen.stdout))
        stderr = asyncio.ensure_future(_pump_pipe(popen.stderr, self._keep_stderr, [0]))
        stderr.add_done_callback(_consume_result)
        first: List["asyncio.Future[Any]"] = [reader, self.child.exited]
        await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
        if self.child.running:
            # A server that closed its stdout can never answer again.
            self.child.kill_tree(signal.SIGKILL)
            reason = "the server closed its stdout"
        else:
            # Responses written just before exiting still count.
            await asyncio.wait([reader], timeout=OUTPUT_IDLE_GRACE_S)
            reason = ""
        code = await self.child.exited
        # Helpers the server left behind die with it.
        self.child.kill_tree(signal.SIGKILL)
        for task in (reader, stderr):
            task.cancel()
        await asyncio.gather(reader, stderr, return_exceptions=True)
        if self._writer is not None:
            self._writer.close()
        self.mark_dead(code, reason)

    async def _read_stdout(self, pipe: Any) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=MCP_MAX_LINE_BYTES)
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
        try:
            while True:
                try:
                    line = await reader.readline()
                except ValueError:
                    _log("MCP server %s wrote a line over %d bytes; dropped" % (self.label, MCP_MAX_LINE_BYTES))
                    continue
                if not line:
                    return
                line = line.strip()
                if not line:
                    continue
                try:
                    msg = json.loads(line.decode("utf-8"))
                except ValueError:
                    continue  # not protocol output; servers must log to stderr
                self._from_upstream(msg)
        finally:
            transport.close()

    async def _keep_stderr(self, data: bytes) -> None:
        self._stderr.append(data)
        self._stderr_size += len(data)
        while self._stderr_size - len(self._stderr[0]) >= MCP_STDERR_TAIL_BYTES:
            self._stderr_size -= len(self._stderr.popleft())

    async def _send(self, msg: Json) -> None:
        await self._ready.wait()
        if self.dead or self._writer is None or self._writer.is_closing():
            raise self.dead_error()
        self._writer.write(json.dumps(msg, separators=(",", ":")).encode("utf-8") + b"\n")
        try:
            async with self._drain_lock:
                await self._writer.drain()
        except (ConnectionError, RuntimeError):
            raise self.dead_error() from None

    def kill(self) -> None:
        if self.child.running:
            self.child.kill_tree(signal.SIGKILL)

    async def stop(self) -> None:
        self.kill()
        try:
            await asyncio.wait_for(self.done.wait(), 10)
        except asyncio.TimeoutError:
            pass


def _sse_messages(stream: Any) -> Iterable[str]:
    """The data of each event of a text/event-stream body."""
    data: List[str] = []
    while True:
        raw = stream.readline(MCP_MAX_LINE_BYTES)
        if not raw:
            if data:
                yield "\n".join(data)
            return
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if line == "":
            if data:
                yield "\n".join(data)
            data = []
        elif line.startswith("data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(" ") else value)
        # Other fields (event, id, retry) and comments carry nothing we route.


class HttpBroker(McpBroker):
    """An MCP server reached over streamable HTTP from the sandbox's network.

    The upstream session (``Mcp-Session-Id``) belongs to the broker, so all
    clients of the label share it. ``close_upstream`` ends it with DELETE;
    the next request then re-runs the cached handshake upstream and
    continues transparently, as it does when the server answers 404 for an
    expired session. Server messages are read from each POST's response
    stream; the optional standalone GET stream is not opened.
    """

    transport = "http"

    def __init__(self, label: str, url: str, headers: Dict[str, str], proxies: Dict[str, str]) -> None:
        super().__init__(label)
        self.url = url
        self.headers = headers
        self.session_id: Optional[str] = None
        self.protocol_version: Optional[str] = None
        self._upstream_ready = False
        self._reinit_lock = asyncio.Lock()
        # Imported on first use: urllib costs sandboxd's start-up ~25 ms.
        import urllib.request

        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler(proxies))

    def _handshake_done(self, result: Json) -> None:
        version = result.get("protocolVersion")
        self.protocol_version = version if isinstance(version, str) else None
        self._upstream_ready = True

    def _headers(self, session_id: Optional[str]) -> Dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        headers.update(self.headers)
        if session_id is not None:
            headers["Mcp-Session-Id"] = session_id
        if self.protocol_version is not None:
            headers["MCP-Protocol-Version"] = self.protocol_version
        return headers

    def _post_blocking(self, msg: Json, session_id: Optional[str], wait_for: Optional[int], deliver: Callable[[Any], None]) -> Tuple[int, Optional[str], str]:
        """POSTs one message; returns (HTTP status or 0, session id header, error detail)."""
        import http.client
        import urllib.error
        import urllib.request

        body = json.dumps(msg, separators=(",", ":")).encode("utf-8")
        request = urllib.request.Request(self.url, data=body, headers=self._headers(session_id), method="POST")
        try:
            response = self._opener.open(request, timeout=MCP_HTTP_TIMEOUT_S)
        except urllib.error.HTTPError as exc:
            try:
                detail = exc.read(2048).decode("utf-8", "replace")
            except (OSError, http.client.HTTPException):
                detail = ""
            exc.close()
            return exc.code, None, detail or str(exc.reason)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            return 0, None, str(getattr(exc, "reason", exc))
        try:
            new_session = response.headers.get("Mcp-Session-Id")
            content_type = (response.headers.get("Content-Type") or "").split(";")[0].strip().lower()
            if content_type == "text/event-stream":
                for data in _sse_messages(response):
                    try:
                        parsed = json.loads(data)
                    except ValueError:
                        continue
                    deliver(parsed)
                    if wait_for is not None and isinstance(parsed, dict) and parsed.get("id") == wait_for and "method" not in parsed:
                        break
            elif content_type == "application/json":
                raw = response.read()
                if raw.strip():
                    try:
                        deliver(json.loads(raw.decode("utf-8")))
                    except ValueError:
                        return response.status, new_session, "the response is not JSON"
            return response.status, new_session, ""
        except (OSError, http.client.HTTPException) as exc:
            return 0, new_session, "reading the response failed: %s" % exc
        finally:
            response.close()

    async def _post(self, msg: Json, wait_for: Optional[int]) -> Tuple[int, str]:
        loop = asyncio.get_running_loop()

        def deliver(parsed: Any) -> None:
            loop.call_soon_threadsafe(self._from_upstream, parsed)

        sent_session = self.session_id
        status, new_session, detail = await _in_thread(self._post_blocking, msg, sent_session, wait_for, deliver)
        if new_session and msg.get("method") == "initialize" and 200 <= status < 300:
            self.session_id = new_session
        if status == 404 and sent_session is not None and self.session_id == sent_session:
            # The server ended the session (or forgot it): handshake again.
            self.session_id = None
            self._upstream_ready = False
        return status, detail

    async def _reinitialize(self) -> None:
        async with self._reinit_lock:
            if self._upstream_ready or self._init_result is None:
                return
            init_id = next(self._ids)
            future: "asyncio.Future[Json]" = asyncio.get_running_loop().create_future()
            self._pending[init_id] = future
            try:
                init = {"jsonrpc": "2.0", "id": init_id, "method": "initialize", "params": self._init_params}
                status, detail = await self._post(init, init_id)
                result = future.result().get("result") if future.done() else None
                if not isinstance(result, dict):
                    raise OpError("unavailable", "re-initializing MCP server %s failed: HTTP %s %s" % (self.label, status, detail))
            finally:
                self._pending.pop(init_id, None)
            version = result.get("protocolVersion")
            self.protocol_version = version if isinstance(version, str) else None
            await self._post({"jsonrpc": "2.0", "method": "notifications/initialized"}, None)
            self._initialized_sent = True
            self._handshake_done(result)

    async def _send_request(self, msg: Json, upstream_id: int) -> None:
        handshake = msg.get("method") == "initialize"
        for attempt in range(2):
            if not handshake and not self._upstream_ready:
                try:
                    await self._reinitialize()
                except OpError as exc:
                    self._fail_request(upstream_id, exc.message, 0)
                    return
            status, detail = await self._post(msg, upstream_id)
            if status == 404 and attempt == 0 and not handshake and not self._upstream_ready:
                continue  # the session expired; retry once on a fresh one
            if status == 0:
                self._fail_request(upstream_id, "MCP server %s is unreachable: %s" % (self.label, detail), status)
            elif not 200 <= status < 300:
                self._fail_request(upstream_id, "MCP server %s answered HTTP %d: %s" % (self.label, status, detail), status)
            else:
                # A no-op when the response arrived (it is delivered before the POST returns).
                self._fail_request(upstream_id, "MCP server %s ended its response without answering" % self.label, status)
            return

    def _fail_request(self, upstream_id: int, message: str, status: int) -> None:
        """Answers a request that got no response with a JSON-RPC error, so
        the caller sees a failed MCP request rather than a broken sandbox."""
        future = self._pending.get(upstream_id)
        if future is not None and not future.done():
            future.set_result(_jsonrpc_error(upstream_id, MCP_UPSTREAM_ERROR, message, {"http_status": status}))

    async def _send(self, msg: Json) -> None:
        if self.dead:
            raise self.dead_error()
        if not self._upstream_ready and self._init_result is not None:
            try:
                await self._reinitialize()
            except OpError as exc:
                # Notifications are fire-and-forget; the next request reports it.
                _log(exc.message)
                return
        await self._post(msg, None)

    def _delete_blocking(self, session_id: str) -> int:
        import http.client
        import urllib.error
        import urllib.request

        request = urllib.request.Request(self.url, headers=self._headers(session_id), method="DELETE")
        try:
            with self._opener.open(request, timeout=30) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            exc.close()
            return int(exc.code)
        except (OSError, http.client.HTTPException, ValueError):
            return 0

    async def close_upstream(self) -> bool:
        session_id, self.session_id = self.session_id, None
        self._upstream_ready = False
        if session_id is None:
            return False
        await _in_thread(self._delete_blocking, session_id)
        return True

    async def stop(self) -> None:
        if not self.dead:
            await self.close_upstream()
        self.mark_dead(None, "stopped")

    def kill(self) -> None:
        self.mark_dead(None, "stopped")


# ---------------------------------------------------------------- connections


class Connection:
    def __init__(self, daemon: "Daemon", reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.daemon = daemon
        self.reader = reader
        self.writer = writer
        self.tasks: Dict[int, "asyncio.Task[None]"] = {}
        # Python 3.9 asserts on concurrent drain() calls, so drains take turns.
        self._drain_lock = asyncio.Lock()

    async def send(self, frame: Json) -> None:
        if self.writer.is_closing():
            raise ConnectionResetError("client went away")
        # One write() call per frame keeps concurrent senders from interleaving.
        self.writer.write(encode_frame(frame))
        async with self._drain_lock:
            await self.writer.drain()

    async def serve(self) -> None:
        try:
            if await self._handshake():
                await self._read_requests()
        except (ProtocolError, ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
            if isinstance(exc, ProtocolError):
                try:
                    await self.send({"id": None, "final": True, "error": {"code": "invalid_argument", "message": str(exc)}})
                except ConnectionError:
                    pass
        finally:
            for task in list(self.tasks.values()):
                task.cancel()
            if self.tasks:
                await asyncio.gather(*self.tasks.values(), return_exceptions=True)
            self.writer.close()

    async def _handshake(self) -> bool:
        hello = await asyncio.wait_for(read_frame(self.reader), timeout=30)
        if hello is None:
            return False
        version = hello.get("v")
        if hello.get("op") != "hello" or isinstance(version, bool) or not isinstance(version, int):
            await self.send({"ok": False, "error": {"code": "invalid_argument", "message": "expected hello"}})
            return False
        if version != PROTOCOL_VERSION:
            await self.send(
                {
                    "ok": False,
                    "v": PROTOCOL_VERSION,
                    "error": {
                        "code": "failed_precondition",
                        "message": "unsupported protocol version %d; this daemon speaks %d" % (version, PROTOCOL_VERSION),
                    },
                }
            )
            return False
        await self.send(
            {
                "ok": True,
                "v": PROTOCOL_VERSION,
                "pid": os.getpid(),
                "workspace": VIRTUAL_ROOT,
                "root": self.daemon.root,
                "isolation": self.daemon.isolation,
            }
        )
        return True

    async def _read_requests(self) -> None:
        while True:
            frame = await read_frame(self.reader)
            if frame is None:
                return
            rid = frame.get("id")
            op = frame.get("op")
            if op == "cancel":
                target_id = frame.get("target")
                target = self.tasks.get(target_id) if isinstance(target_id, int) else None
                if target is not None:
                    target.cancel()
                if rid is not None:
                    await self.send({"id": rid, "final": True, "cancelled": target is not None})
                continue
            if isinstance(rid, bool) or not isinstance(rid, int):
                await self.send({"id": None, "final": True, "error": {"code": "invalid_argument", "message": "request id must be an integer"}})
                continue
            if rid in self.tasks:
                await self.send({"id": rid, "final": True, "error": {"code": "invalid_argument", "message": "request id %d is in use" % rid}})
                continue
            task = asyncio.ensure_future(self._run(rid, op, frame))
            self.tasks[rid] = task
            task.add_done_callback(functools.partial(self._forget, rid))

    def _forget(self, rid: int, task: "asyncio.Task[None]") -> None:
        if self.tasks.get(rid) is task:
            del self.tasks[rid]

    async def _run(self, rid: int, op: Any, req: Json) -> None:
        handler = self.daemon.handlers.get(op) if isinstance(op, str) else None
        try:
            if handler is None:
                raise OpError("invalid_argument", "unknown op %r" % (op,))
            result = await handler(self, rid, req)
            final: Json = {"id": rid, "final": True}
            final.update(result)
            await self.send(final)
        except OpError as exc:
            await self._send_quietly({"id": rid, "final": True, "error": exc.frame()})
        except ConnectionError:
            # The client is gone; the connection's reader notices and cleans up.
            pass
        except Exception as exc:  # a bug in one op must not take the connection down
            _log("op %r failed: %r" % (op, exc))
            await self._send_quietly({"id": rid, "final": True, "error": {"code": "internal", "message": repr(exc)}})

    async def _send_quietly(self, frame: Json) -> None:
        try:
            await self.send(frame)
        except ConnectionError:
            pass


# ---------------------------------------------------------------- the daemon


Handler = Callable[[Connection, int, Json], Awaitable[Json]]


class Daemon:
    def __init__(
        self,
        socket_path: str,
        workspace: str,
        state_dir: str,
        isolation: str,
        extra_env: Dict[str, str],
        ring_bytes: int,
        env_loader: Optional[Callable[[], Dict[str, str]]] = None,
    ) -> None:
        self.socket_path = socket_path
        self.root = os.path.realpath(workspace)
        self.state_dir = state_dir
        self.procs_dir = os.path.join(state_dir, "procs")
        self.isolation = isolation
        self.extra_env = extra_env
        self.env_loader = env_loader
        self.ring_bytes = ring_bytes
        self.processes: Dict[str, ManagedProcess] = {}
        self.brokers: Dict[str, McpBroker] = {}
        self.connections: Set[Connection] = set()
        self._stop: Optional[asyncio.Event] = None
        self._reaper: Optional[Reaper] = None
        self._exec_ids = itertools.count(1)
        self.handlers: Dict[str, Handler] = {
            "ping": self._op_ping,
            "shutdown": self._op_shutdown,
            "exec": self._op_exec,
            "process.start": self._op_process_start,
            "process.attach": self._op_process_attach,
            "process.list": self._op_process_list,
            "process.wait": self._op_process_wait,
            "process.kill": self._op_process_kill,
            "file.write": self._op_file_write,
            "file.read": self._op_file_read,
            "file.list": self._op_file_list,
            "file.stat": self._op_file_stat,
            "file.mkdir": self._op_file_mkdir,
            "file.remove": self._op_file_remove,
            "mcp.start": self._op_mcp_start,
            "mcp.request": self._op_mcp_request,
            "mcp.notify": self._op_mcp_notify,
            "mcp.subscribe": self._op_mcp_subscribe,
            "mcp.list": self._op_mcp_list,
            "mcp.stop": self._op_mcp_stop,
            "mcp.close_upstream": self._op_mcp_close_upstream,
            "env.reload": self._op_env_reload,
            "egress.relay": self._op_egress_relay,
        }
        self.egress_relay: Optional[EgressRelay] = None

    @property
    def reaper(self) -> Reaper:
        assert self._reaper is not None
        return self._reaper

    # ------------------------------------------------------------ lifecycle

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._reaper = Reaper(loop)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        os.makedirs(self.procs_dir, exist_ok=True)
        os.makedirs(self.root, exist_ok=True)
        sock = _bind_unix_socket(self.socket_path)
        server = await asyncio.start_unix_server(self._on_connection, sock=sock, limit=1024 * 1024)
        pid_file = os.path.join(self.state_dir, "sandboxd.pid")
        with open(pid_file, "w") as handle:
            handle.write("%d\n" % os.getpid())
        _log("listening on %s (workspace %s, isolation %s)" % (self.socket_path, self.root, self.isolation))
        try:
            await self._stop.wait()
        finally:
            server.close()
            if self.egress_relay is not None:
                self.egress_relay.close()
            self._kill_all()
            for conn in list(self.connections):
                conn.writer.close()
            for path in (pid_file, self.socket_path):
                try:
                    os.unlink(path)
                except OSError:
                    pass

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Connection(self, reader, writer)
        self.connections.add(conn)
        try:
            await conn.serve()
        finally:
            self.connections.discard(conn)

    def _kill_all(self) -> None:
        for broker in self.brokers.values():
            broker.kill()
        for proc in self.processes.values():
            if proc.running:
                proc.child.kill_tree(signal.SIGKILL)
        for child in self.reaper.live_children():
            child.kill_tree(signal.SIGKILL)

    # ------------------------------------------------------------ paths and environment

    def _to_host(self, value: str) -> str:
        if self.root == VIRTUAL_ROOT:
            return value
        if value == VIRTUAL_ROOT or value.startswith(VIRTUAL_ROOT + "/"):
            return self.root + value[len(VIRTUAL_ROOT) :]
        return value

    def _to_virtual(self, real: str) -> str:
        rel = os.path.relpath(real, self.root)
        return VIRTUAL_ROOT if rel == "." else VIRTUAL_ROOT + "/" + rel

    def _within_root(self, real: str) -> bool:
        return real == self.root or real.startswith(self.root.rstrip("/") + "/")

    def resolve(self, path: Any, follow_final: bool = True) -> str:
        """Maps a request path onto the host and enforces confinement."""
        if not isinstance(path, str) or path == "" or "\0" in path:
            raise OpError("invalid_argument", "path must be a non-empty string")
        if path == VIRTUAL_ROOT or path.startswith(VIRTUAL_ROOT + "/"):
            rel = path[len(VIRTUAL_ROOT) :]
        elif self._within_root(path):
            rel = path[len(self.root) :]
        elif path.startswith("/"):
            raise OpError("invalid_argument", "%s is outside %s" % (path, VIRTUAL_ROOT))
        else:
            rel = path
        rel = rel.lstrip("/")
        normal = posixpath.normpath(rel) if rel else "."
        if normal == ".." or normal.startswith("../"):
            raise OpError("invalid_argument", "%s escapes %s" % (path, VIRTUAL_ROOT))
        lexical = self.root if normal == "." else os.path.join(self.root, normal)
        if lexical == self.root:
            return lexical
        if follow_final:
            real = os.path.realpath(lexical)
        else:
            real = os.path.join(os.path.realpath(os.path.dirname(lexical)), os.path.basename(lexical))
        if not self._within_root(real):
            raise OpError("permission_denied", "%s resolves outside %s through a symlink" % (path, VIRTUAL_ROOT))
        return real

    def _cwd(self, req: Json) -> str:
        cwd = _opt_str(req, "cwd")
        if cwd is None or cwd == "":
            return self.root
        real = self._to_host(cwd) if cwd.startswith("/") else os.path.join(self.root, cwd)
        if not os.path.isdir(real):
            raise OpError("invalid_argument", "cwd %s is not a directory" % cwd)
        return real

    def _env(self, req: Json, marker: str) -> Dict[str, str]:
        env = {"PATH": DEFAULT_PATH, "HOME": VIRTUAL_ROOT, "LANG": "C.UTF-8"}
        env.update(self.extra_env)
        env.update(_opt_env(req))
        if self.root != VIRTUAL_ROOT:
            env = {key: ":".join(self._to_host(part) for part in value.split(":")) for key, value in env.items()}
        env["BERTH_WORKSPACE"] = self.root
        env[MARKER_ENV] = marker
        return env

    def _spawn(self, req: Json, marker: str, stdin_pipe: bool) -> Child:
        argv = _command_argv(req)
        cwd = self._cwd(req)
        env = self._env(req, marker)
        return self.reaper.spawn(argv, cwd, env, marker, stdin_pipe)

    # ------------------------------------------------------------ misc ops

    async def _op_ping(self, conn: Connection, rid: int, req: Json) -> Json:
        running = sum(1 for p in self.processes.values() if p.running)
        return {"ok": True, "pid": os.getpid(), "processes": running}

    async def _op_env_reload(self, conn: Connection, rid: int, req: Json) -> Json:
        if self.env_loader is None:
            raise OpError("failed_precondition", "this daemon was started without an environment to reload")
        try:
            env = self.env_loader()
        except (OSError, ValueError) as exc:
            raise OpError("failed_precondition", "cannot reload the environment: %s" % exc) from None
        self.extra_env = env
        return {"ok": True, "variables": len(env)}

    async def _op_egress_relay(self, conn: Connection, rid: int, req: Json) -> Json:
        port = _opt_int(req, "port", 0) or 0
        target = _req_str(req, "socket")
        if not 0 <= port <= 65535:
            raise OpError("invalid_argument", "port must be between 0 and 65535", param="port")
        relay = self.egress_relay
        if relay is not None:
            if relay.socket_path == target and port in (0, relay.port):
                await relay.ready
                return {"ok": True, "port": relay.port}
            raise OpError("failed_precondition", "an egress relay already listens on port %d" % relay.port)
        relay = self.egress_relay = EgressRelay(port, target)
        try:
            await relay.start()
        except OSError as exc:
            self.egress_relay = None
            raise OpError("failed_precondition", "cannot listen on 127.0.0.1:%d: %s" % (port, exc)) from None
        _log("egress relay on 127.0.0.1:%d to %s" % (relay.port, target))
        return {"ok": True, "port": relay.port}

    async def _op_shutdown(self, conn: Connection, rid: int, req: Json) -> Json:
        self._kill_all()
        assert self._stop is not None
        # Let the final frame go out before the server stops.
        asyncio.get_running_loop().call_soon(self._stop.set)
        return {"ok": True}

    # ------------------------------------------------------------ exec

    async def _op_exec(self, conn: Connection, rid: int, req: Json) -> Json:
        timeout = _opt_positive_float(req, "timeout_s")
        stdin_data = _unb64(req["stdin_b64"], "stdin_b64") if req.get("stdin_b64") is not None else None
        marker = "exec_%d_%s" % (next(self._exec_ids), secrets.token_hex(4))
        try:
            child = self._spawn(req, marker, stdin_data is not None)
        except (FileNotFoundError, PermissionError) as exc:
            # Mirror a shell: a missing or non-executable command is an exit
            # status, not a protocol error.
            await conn.send({"id": rid, "type": "chunk", "stream": "stderr", "seq": 0, "data_b64": _b64(("sandboxd: %s\n" % exc).encode())})
            code = 127 if isinstance(exc, FileNotFoundError) else 126
            return {"type": "exit", "exit_code": code, "timed_out": False, "duration_ms": 0}
        seq = itertools.count()
        progress = [0]

        def sender(stream: str) -> Callable[[bytes], Awaitable[None]]:
            async def send(data: bytes) -> None:
                await conn.send({"id": rid, "type": "chunk", "stream": stream, "seq": next(seq), "data_b64": _b64(data)})

            return send

        pumps = [
            asyncio.ensure_future(_pump_pipe(child.popen.stdout, sender("stdout"), progress)),
            asyncio.ensure_future(_pump_pipe(child.popen.stderr, sender("stderr"), progress)),
        ]
        for pump in pumps:
            pump.add_done_callback(_consume_result)
        timed_out = False
        try:
            if stdin_data is not None:
                await _feed_stdin(child.popen.stdin, stdin_data)
            try:
                code = await asyncio.wait_for(asyncio.shield(child.exited), timeout)
            except asyncio.TimeoutError:
                timed_out = True
                child.kill_tree(signal.SIGKILL)
                code = await child.exited
            await _drain_after_exit(pumps, progress)
        except BaseException:
            child.kill_tree(signal.SIGKILL)
            for pump in pumps:
                pump.cancel()
            raise
        ended = child.ended or time.monotonic()
        return {
            "type": "exit",
            "exit_code": EXEC_TIMEOUT_EXIT_CODE if timed_out else code,
            "timed_out": timed_out,
            "duration_ms": int((ended - child.started) * 1000),
        }

    # ------------------------------------------------------------ background processes

    def _process(self, req: Json) -> ManagedProcess:
        process_id = _req_str(req, "process_id")
        proc = self.processes.get(process_id)
        if proc is None:
            raise OpError("not_found", "no process %s" % process_id)
        return proc

    async def _op_process_start(self, conn: Connection, rid: int, req: Json) -> Json:
        name = _opt_str(req, "name") or ""
        keepalive = _opt_bool(req, "keepalive", False)
        process_id = "proc_" + secrets.token_hex(8)
        try:
            child = self._spawn(req, process_id, False)
        except FileNotFoundError as exc:
            raise OpError("not_found", str(exc)) from None
        except PermissionError as exc:
            raise OpError("permission_denied", str(exc)) from None
        log_path = os.path.join(self.procs_dir, process_id + ".log")
        proc = ManagedProcess(process_id, name, child, keepalive, log_path, self.ring_bytes)
        self.processes[process_id] = proc
        self._forget_old_processes()
        proc.supervisor = asyncio.ensure_future(self._supervise(proc))
        return {
            "process_id": process_id,
            "pid": child.pid,
            "name": name,
            "keepalive": keepalive,
            "started_at": proc.started_at,
        }

    async def _supervise(self, proc: ManagedProcess) -> None:
        progress = [0]

        def recorder(stream: int) -> Callable[[bytes], Awaitable[None]]:
            async def record(data: bytes) -> None:
                proc.append(stream, data)

            return record

        pumps = [
            asyncio.ensure_future(_pump_pipe(proc.child.popen.stdout, recorder(1), progress)),
            asyncio.ensure_future(_pump_pipe(proc.child.popen.stderr, recorder(2), progress)),
        ]
        for pump in pumps:
            pump.add_done_callback(_consume_result)
        code = await proc.child.exited
        # Output already in the pipes belongs before the exit frame; whatever a
        # leftover child writes later is still recorded, after it.
        pending = [p for p in pumps if not p.done()]
        last = -1
        while pending and progress[0] != last:
            last = progress[0]
            _, still = await asyncio.wait(pending, timeout=OUTPUT_IDLE_GRACE_S)
            pending = list(still)
        proc.finish(code)
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        proc.close_log()

    def _forget_old_processes(self) -> None:
        exited = [p for p in self.processes.values() if not p.running]
        for proc in exited[: max(0, len(exited) - MAX_EXITED_PROCESSES)]:
            del self.processes[proc.process_id]

    async def _op_process_attach(self, conn: Connection, rid: int, req: Json) -> Json:
        proc = self._process(req)
        seq = max(0, _opt_int(req, "from_seq", 0) or 0)
        while True:
            changed = proc.changed()
            if seq < proc.next_seq:
                if seq < proc.ring_first_seq:
                    records = proc.from_log(seq, proc.ring_first_seq, MAX_READ_CHUNK)
                    if not records:
                        # Lost from the log too (disk full): continue from the ring.
                        seq = proc.ring_first_seq
                        continue
                else:
                    records = proc.from_ring(seq, MAX_READ_CHUNK)
                for rec_seq, stream, data in records:
                    await conn.send(
                        {"id": rid, "type": "chunk", "stream": _STREAM_NAMES[stream], "seq": rec_seq, "data_b64": _b64(data)}
                    )
                    seq = rec_seq + 1
                continue
            if proc.finished.is_set():
                return proc.exit_frame()
            await changed.wait()

    async def _op_process_list(self, conn: Connection, rid: int, req: Json) -> Json:
        return {"processes": [p.describe() for p in self.processes.values()]}

    async def _op_process_wait(self, conn: Connection, rid: int, req: Json) -> Json:
        proc = self._process(req)
        timeout = _opt_positive_float(req, "timeout_s")
        try:
            await asyncio.wait_for(proc.finished.wait(), timeout)
        except asyncio.TimeoutError:
            return {"running": True, "timed_out": True}
        frame = proc.exit_frame()
        frame["running"] = False
        return frame

    async def _op_process_kill(self, conn: Connection, rid: int, req: Json) -> Json:
        proc = self._process(req)
        sig = _parse_signal(req.get("signal"))
        signalled = proc.child.kill_tree(sig) if proc.running else 0
        if sig == signal.SIGKILL and proc.running:
            try:
                await asyncio.wait_for(proc.finished.wait(), 10)
            except asyncio.TimeoutError:
                pass
        return {"signalled": signalled, "running": proc.running, "exit_code": proc.exit_code}

    # ------------------------------------------------------------ MCP brokers

    def _broker(self, req: Json) -> McpBroker:
        label = _mcp_label(req)
        broker = self.brokers.get(label)
        if broker is None:
            raise OpError("not_found", "no MCP broker %s in this sandbox" % label, param="label")
        return broker

    def _sandbox_env(self) -> Dict[str, str]:
        env = dict(os.environ)
        env.update(self.extra_env)
        return env

    def _new_broker(self, label: str, transport: Any) -> McpBroker:
        if not isinstance(transport, dict):
            raise OpError("invalid_argument", "transport must be an object", param="transport")
        kind = transport.get("type")
        if kind == "stdio":
            return self._new_stdio_broker(label, transport)
        if kind == "http":
            url = _req_str(transport, "server_url")
            if not (url.startswith("http://") or url.startswith("https://")):
                raise OpError("invalid_argument", "server_url must be an http or https URL", param="server_url")
            headers = _str_dict(transport.get("headers"), "headers")
            if any("\r" in v or "\n" in v or "\r" in k or "\n" in k for k, v in headers.items()):
                raise OpError("invalid_argument", "headers must not contain line breaks", param="headers")
            return HttpBroker(label, url, headers, self._proxies(url))
        raise OpError("invalid_argument", "transport.type must be stdio or http", param="transport")

    def _new_stdio_broker(self, label: str, transport: Json) -> StdioBroker:
        command = _req_str(transport, "command")
        args = _str_list(transport.get("args"), "args")
        inherit = _str_list(transport.get("env_vars"), "env_vars")
        explicit = _opt_env(transport)
        cwd = self._cwd(transport)
        marker = "mcp_" + secrets.token_hex(8)
        # Only the named variables of the sandbox's environment reach the
        # server, on top of the basics every command gets.
        sandbox_env = self._sandbox_env()
        env = {"PATH": DEFAULT_PATH, "HOME": VIRTUAL_ROOT, "LANG": "C.UTF-8"}
        env.update({name: sandbox_env[name] for name in inherit if name in sandbox_env})
        env.update(explicit)
        if self.root != VIRTUAL_ROOT:
            env = {key: ":".join(self._to_host(part) for part in value.split(":")) for key, value in env.items()}
        env["BERTH_WORKSPACE"] = self.root
        env[MARKER_ENV] = marker
        try:
            child = self.reaper.spawn([command] + args, cwd, env, marker, True)
        except (FileNotFoundError, PermissionError, NotADirectoryError) as exc:
            raise OpError("invalid_argument", "cannot start MCP server %s: %s" % (label, exc), param="command") from None
        return StdioBroker(label, child)

    def _proxies(self, url: str) -> Dict[str, str]:
        """The sandbox's proxy settings, so HTTP brokers reach the network as
        the sandbox's own commands do."""
        env = self._sandbox_env()
        proxies: Dict[str, str] = {}
        for scheme in ("http", "https"):
            value = env.get(scheme + "_proxy") or env.get(scheme.upper() + "_PROXY")
            if value:
                proxies[scheme] = value
        no_proxy = env.get("no_proxy") or env.get("NO_PROXY") or ""
        if proxies and no_proxy:
            import urllib.parse

            host = (urllib.parse.urlsplit(url).hostname or "").lower()
            for entry in no_proxy.split(","):
                entry = entry.strip().lower().lstrip(".")
                if entry == "*" or (entry and (host == entry or host.endswith("." + entry))):
                    return {}
        return proxies

    async def _op_mcp_start(self, conn: Connection, rid: int, req: Json) -> Json:
        label = _mcp_label(req)
        broker = self.brokers.get(label)
        created = broker is None
        if broker is None:
            # Nothing awaits between the lookup and the registration, so of
            # concurrent first starts exactly one creates the broker; every
            # later start, alive or dead, gets it without comparing configs.
            broker = self._new_broker(label, req.get("transport"))
            self.brokers[label] = broker
        info = broker.describe()
        info["created"] = created
        return info

    async def _op_mcp_request(self, conn: Connection, rid: int, req: Json) -> Json:
        broker = self._broker(req)
        message = _mcp_message(req)
        if not _is_request(message):
            raise OpError("invalid_argument", "mcp.request takes a request (method and id); send others with mcp.notify", param="message")
        return {"message": await broker.request(message)}

    async def _op_mcp_notify(self, conn: Connection, rid: int, req: Json) -> Json:
        broker = self._broker(req)
        message = _mcp_message(req)
        if not (_is_notification(message) or _is_response(message)):
            raise OpError("invalid_argument", "mcp.notify takes a notification or a response; send requests with mcp.request", param="message")
        return {"forwarded": await broker.notify(message)}

    async def _op_mcp_subscribe(self, conn: Connection, rid: int, req: Json) -> Json:
        broker = self._broker(req)
        if broker.dead:
            raise broker.dead_error()
        sub = broker.subscribe()
        try:
            await conn.send({"id": rid, "type": "subscribed", "label": broker.label})
            while True:
                while sub.queue:
                    await conn.send({"id": rid, "type": "message", "message": sub.queue.popleft()})
                if sub.closed:
                    break
                sub.wakeup.clear()
                await sub.wakeup.wait()
        finally:
            broker.unsubscribe(sub)
        return {"state": broker.state, "dropped": sub.dropped}

    async def _op_mcp_list(self, conn: Connection, rid: int, req: Json) -> Json:
        return {"brokers": [broker.describe() for broker in self.brokers.values()]}

    async def _op_mcp_stop(self, conn: Connection, rid: int, req: Json) -> Json:
        broker = self._broker(req)
        await broker.stop()
        return broker.describe()

    async def _op_mcp_close_upstream(self, conn: Connection, rid: int, req: Json) -> Json:
        broker = self._broker(req)
        closed = False if broker.dead else await broker.close_upstream()
        return {"closed": closed}

    # ------------------------------------------------------------ files

    async def _blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        # File I/O runs off the loop so a slow disk never stalls other requests.
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def _op_file_write(self, conn: Connection, rid: int, req: Json) -> Json:
        path = req.get("path")
        data = _unb64(req.get("data_b64", ""), "data_b64")
        if len(data) > MAX_WRITE_BYTES:
            raise OpError("invalid_argument", "at most %d bytes per write" % MAX_WRITE_BYTES)
        mode = _opt_int(req, "mode", None)
        if mode is not None and not 0 <= mode <= 0o7777:
            raise OpError("invalid_argument", "mode must be a permission mode")
        append = _opt_bool(req, "append", False)
        parents = _opt_bool(req, "mkdir_parents", True)
        real = self.resolve(path)
        if real == self.root:
            raise OpError("failed_precondition", "%s is a directory" % path)
        size = await self._blocking(_write_file, real, data, mode, append, parents, str(path))
        return {"size": size}

    async def _op_file_read(self, conn: Connection, rid: int, req: Json) -> Json:
        path = req.get("path")
        offset = _opt_int(req, "offset", 0) or 0
        length = _opt_int(req, "length", None)
        if offset < 0 or (length is not None and length < 0):
            raise OpError("invalid_argument", "offset and length must not be negative")
        real = self.resolve(path)
        fd, size = await self._blocking(_open_for_read, real, str(path))
        try:
            end = size if length is None else min(size, offset + length)
            position = offset
            while position < end:
                data = await self._blocking(os.pread, fd, min(MAX_READ_CHUNK, end - position), position)
                if not data:
                    break
                await conn.send({"id": rid, "type": "chunk", "data_b64": _b64(data)})
                position += len(data)
        finally:
            os.close(fd)
        return {"size": size}

    async def _op_file_list(self, conn: Connection, rid: int, req: Json) -> Json:
        path = req.get("path") or VIRTUAL_ROOT
        recursive = _opt_bool(req, "recursive", False)
        real = self.resolve(path)
        entries, truncated = await self._blocking(self._list, real, recursive, str(path))
        return {"entries": entries, "truncated": truncated}

    async def _op_file_stat(self, conn: Connection, rid: int, req: Json) -> Json:
        path = req.get("path")
        real = self.resolve(path, follow_final=False)
        try:
            st = os.lstat(real)
        except OSError as exc:
            raise _os_error(exc, str(path)) from None
        return {"entry": self._entry(real, st)}

    async def _op_file_mkdir(self, conn: Connection, rid: int, req: Json) -> Json:
        path = req.get("path")
        parents = _opt_bool(req, "parents", True)
        real = self.resolve(path)
        try:
            if parents:
                os.makedirs(real, exist_ok=True)
            else:
                os.mkdir(real)
        except OSError as exc:
            raise _os_error(exc, str(path)) from None
        return {"path": self._to_virtual(real)}

    async def _op_file_remove(self, conn: Connection, rid: int, req: Json) -> Json:
        path = req.get("path")
        recursive = _opt_bool(req, "recursive", False)
        real = self.resolve(path, follow_final=False)
        if real == self.root:
            raise OpError("invalid_argument", "the workspace root cannot be removed")
        await self._blocking(_remove, real, recursive, str(path))
        return {"removed": True}

    def _entry(self, real: str, st: os.stat_result) -> Json:
        if stat.S_ISLNK(st.st_mode):
            kind = "symlink"
        elif stat.S_ISDIR(st.st_mode):
            kind = "dir"
        elif stat.S_ISREG(st.st_mode):
            kind = "file"
        else:
            kind = "other"
        return {
            "path": self._to_virtual(real),
            "type": kind,
            "size": st.st_size,
            "mode": stat.S_IMODE(st.st_mode),
            "mtime": st.st_mtime,
        }

    def _list(self, real: str, recursive: bool, shown: str) -> Tuple[List[Json], bool]:
        try:
            if not stat.S_ISDIR(os.stat(real).st_mode):
                raise OpError("failed_precondition", "%s is not a directory" % shown)
        except OSError as exc:
            raise _os_error(exc, shown) from None
        entries: List[Json] = []
        for entry_path in _walk(real, recursive):
            if len(entries) >= MAX_LIST_ENTRIES:
                return entries, True
            try:
                entries.append(self._entry(entry_path, os.lstat(entry_path)))
            except OSError:
                continue
        return entries, False


def _walk(top: str, recursive: bool) -> Iterable[str]:
    pending = [top]
    while pending:
        current = pending.pop()
        try:
            with os.scandir(current) as it:
                found = sorted(it, key=lambda e: e.name)
        except OSError:
            continue
        subdirs = []
        for entry in found:
            yield entry.path
            if recursive and entry.is_dir(follow_symlinks=False):
                subdirs.append(entry.path)
        pending.extend(reversed(subdirs))


def _write_file(real: str, data: bytes, mode: Optional[int], append: bool, parents: bool, shown: str) -> int:
    parent = os.path.dirname(real)
    try:
        if parents:
            os.makedirs(parent, exist_ok=True)
        if append:
            fd = os.open(real, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644 if mode is None else mode)
            try:
                _write_all(fd, data)
                if mode is not None:
                    os.fchmod(fd, mode)
                os.fsync(fd)
                return os.fstat(fd).st_size
            finally:
                os.close(fd)
        try:
            existing = os.stat(real)
        except FileNotFoundError:
            existing = None
        if existing is not None and stat.S_ISDIR(existing.st_mode):
            raise OpError("failed_precondition", "%s is a directory" % shown)
        final_mode = mode if mode is not None else (stat.S_IMODE(existing.st_mode) if existing is not None else 0o644)
        tmp = os.path.join(parent, ".%s.%s.berth-tmp" % (os.path.basename(real)[:200], secrets.token_hex(6)))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            try:
                _write_all(fd, data)
                os.fchmod(fd, final_mode)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, real)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        _fsync_dir(parent)
        return len(data)
    except OSError as exc:
        raise _os_error(exc, shown) from None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_for_read(real: str, shown: str) -> Tuple[int, int]:
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise _os_error(exc, shown) from None
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode):
        os.close(fd)
        raise OpError("failed_precondition", "%s is a directory" % shown)
    return fd, st.st_size


def _remove(real: str, recursive: bool, shown: str) -> None:
    try:
        st = os.lstat(real)
        if stat.S_ISDIR(st.st_mode):
            if recursive:
                shutil.rmtree(real)
            else:
                os.rmdir(real)
        else:
            os.unlink(real)
    except OSError as exc:
        raise _os_error(exc, shown) from None


# ---------------------------------------------------------------- egress relay


async def _copy_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copies until EOF, then half-closes; an error closes ``writer`` so the
    opposite direction ends too."""
    try:
        while True:
            data = await reader.read(PIPE_READ_SIZE)
            if not data:
                break
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()


class EgressRelay:
    """A loopback TCP listener whose connections go to a unix socket."""

    def __init__(self, port: int, socket_path: str) -> None:
        self.port = port
        self.socket_path = socket_path
        self.server: Optional[Any] = None
        self.ready: "asyncio.Future[None]" = asyncio.get_running_loop().create_future()

    async def start(self) -> None:
        try:
            self.server = await asyncio.start_server(self._on_client, "127.0.0.1", self.port, reuse_address=True)
        except BaseException as exc:
            self.ready.set_exception(exc)
            self.ready.exception()  # retrieved: a failed start is reported by its own request
            raise
        self.port = self.server.sockets[0].getsockname()[1]
        self.ready.set_result(None)

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_unix_connection(self.socket_path)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(_copy_stream(reader, upstream_writer), _copy_stream(upstream_reader, writer))
        finally:
            upstream_writer.close()
            writer.close()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def _bind_unix_socket(path: str) -> socket.socket:
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dir_fd: Optional[int] = None
    bind_path = path
    if len(os.fsencode(path)) > 100:
        # sun_path holds about 108 bytes; a long host path is reached through
        # a short /proc/self/fd alias of its directory.
        dir_fd = os.open(os.path.dirname(path) or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        bind_path = "/proc/self/fd/%d/%s" % (dir_fd, os.path.basename(path))
    old_umask = os.umask(0o177)
    try:
        sock.bind(bind_path)
    finally:
        os.umask(old_umask)
        if dir_fd is not None:
            os.close(dir_fd)
    os.chmod(path, 0o600)
    sock.listen(128)
    sock.setblocking(False)
    return sock


def _parse_args(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Berth in-sandbox daemon")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--workspace", default=VIRTUAL_ROOT)
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--isolation", default="unknown")
    parser.add_argument("--env-file", help="JSON object of extra environment for every command")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--ring-bytes", type=int, default=DEFAULT_RING_BYTES)
    return parser.parse_args(argv)


def _load_env(env_file: Optional[str], items: List[str]) -> Dict[str, str]:
    """The extra environment: the JSON object in ``env_file`` (if it
    exists), then the ``NAME=VALUE`` items."""
    env: Dict[str, str] = {}
    if env_file and os.path.exists(env_file):
        with open(env_file) as handle:
            loaded = json.load(handle)
        if not isinstance(loaded, dict):
            raise ValueError("%s does not hold a JSON object" % env_file)
        env.update({str(k): str(v) for k, v in loaded.items()})
    for item in items:
        key, _, value = item.partition("=")
        env[key] = value
    return env


def main(argv: Optional[List[str]] = None) -> int:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    extra_env = _load_env(args.env_file, args.env)
    daemon = Daemon(
        socket_path=args.socket,
        workspace=args.workspace,
        state_dir=args.state_dir,
        isolation=args.isolation,
        extra_env=extra_env,
        ring_bytes=max(PIPE_READ_SIZE, args.ring_bytes),
        env_loader=functools.partial(_load_env, args.env_file, args.env),
    )
    asyncio.run(daemon.serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
