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
``failed_precondition``, ``internal``.

Output is streamed as ``{"type": "chunk", "stream": "stdout"|"stderr",
"seq": n, "data_b64"}``; seq numbers are shared by both streams of one command
and count up from 0. Commands end with ``{"type": "exit", "exit_code",
"timed_out", "duration_ms"}``. ``exit_code`` is negative (``-signal``) for a
command killed by a signal, and 124 for an exec killed by its ``timeout_s``.

An exec's leftover background children keep running after it returns (their
later output is dropped); use ``process.start`` for work that should outlive a
request. Background processes start in their own session, outlive the
connection that started them, and keep their exit code after exiting;
``keepalive`` is recorded for the service (e.g. MCP brokers) and never makes
the daemon restart a process. ``process.kill`` signals the whole tree.

Operations: ``exec``, ``process.start``, ``process.attach``, ``process.list``,
``process.wait``, ``process.kill``, ``file.write``, ``file.read``,
``file.list``, ``file.stat``, ``file.mkdir``, ``file.remove``, ``ping``,
``shutdown``. See the ``_op_*`` methods for their fields.

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

_LENGTH = struct.Struct(">I")
_LOG_RECORD = struct.Struct(">QBI")
_STREAM_CODES = {"stdout": 1, "stderr": 2}
_STREAM_NAMES = {1: "stdout", 2: "stderr"}

Json = Dict[str, Any]


def _log(message: str) -> None:
    sys.stderr.write("sandboxd: %s\n" % message)
    sys.stderr.flush()


class OpError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


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
            await self._send_quietly({"id": rid, "final": True, "error": {"code": exc.code, "message": exc.message}})
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
    ) -> None:
        self.socket_path = socket_path
        self.root = os.path.realpath(workspace)
        self.state_dir = state_dir
        self.procs_dir = os.path.join(state_dir, "procs")
        self.isolation = isolation
        self.extra_env = extra_env
        self.ring_bytes = ring_bytes
        self.processes: Dict[str, ManagedProcess] = {}
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
        }

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


def main(argv: Optional[List[str]] = None) -> int:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    extra_env: Dict[str, str] = {}
    if args.env_file and os.path.exists(args.env_file):
        with open(args.env_file) as handle:
            loaded = json.load(handle)
        extra_env.update({str(k): str(v) for k, v in loaded.items()})
    for item in args.env:
        key, _, value = item.partition("=")
        extra_env[key] = value
    daemon = Daemon(
        socket_path=args.socket,
        workspace=args.workspace,
        state_dir=args.state_dir,
        isolation=args.isolation,
        extra_env=extra_env,
        ring_bytes=max(PIPE_READ_SIZE, args.ring_bytes),
    )
    asyncio.run(daemon.serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
