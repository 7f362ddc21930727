"""Process supervision: commands (``exec``) and background processes.

Every child runs in its own session with a marker variable, so its whole
tree can be found and killed, even children that escaped with setsid.

Each background process appends its output to
``<state-dir>/procs/<process_id>.log`` as records of a 13-byte header
(big-endian u64 seq, u8 stream: 1 stdout / 2 stderr, u32 length) followed by
the data, so attaching can replay chunks that have left the in-memory ring.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import itertools
import os
import signal
import struct
import subprocess
import time
from typing import Any, Awaitable, Callable, Deque, Dict, List, Optional, Set, Tuple

from .protocol import (
    MAX_READ_CHUNK,
    Handler,
    Json,
    OpError,
    Sender,
    b64,
    log,
    opt_bool,
    opt_env,
    opt_int,
    opt_positive_float,
    opt_str,
    req_str,
    unb64,
)
from .workspace import Workspace

PIPE_READ_SIZE = 64 * 1024
DEFAULT_RING_BYTES = 1024 * 1024
MAX_EXITED_PROCESSES = 1024
MARKER_ENV = "BERTH_PROCESS_ID"
EXEC_TIMEOUT_EXIT_CODE = 124
# After a command's main process exits, keep reading its pipes while they
# still deliver data; a leftover background child holding them open must not
# keep the exec open forever.
OUTPUT_IDLE_GRACE_S = 0.2
LOG_INDEX_EVERY = 64
# The most stdin bytes a background process may have waiting unread: a write
# beyond it is refused until the process reads what it was given.
MAX_STDIN_BUFFER = 1024 * 1024

_LOG_RECORD = struct.Struct(">QBI")
_STREAM_NAMES = {1: "stdout", 2: "stderr"}


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

    def __init__(self) -> None:
        self._children: Dict[int, Child] = {}

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        """Reaps on every SIGCHLD the loop receives from now on."""
        loop.add_signal_handler(signal.SIGCHLD, self.reap)

    def spawn(self, argv: List[str], cwd: str, env: Dict[str, str], marker: str, stdin_pipe: bool) -> Child:
        """Starts a command in a session of its own, ``marker`` in its
        environment so its whole tree can be found later."""
        env = dict(env)
        env[MARKER_ENV] = marker
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
        child = Child(popen, marker, asyncio.get_running_loop().create_future())
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


def consume_result(task: "asyncio.Task[Any]") -> None:
    if not task.cancelled():
        task.exception()


async def pump_pipe(pipe: Any, on_data: Callable[[bytes], Awaitable[None]], progress: List[int]) -> None:
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


class StdinPipe(asyncio.Protocol):
    """The write end of a background process's stdin. Writes are buffered
    by the transport, up to MAX_STDIN_BUFFER unread bytes."""

    def __init__(self) -> None:
        self.transport: Optional[asyncio.WriteTransport] = None
        self.broken = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Optional[Exception]) -> None:
        # The process closed its end (or exited); further writes fail.
        self.broken = True

    @property
    def open(self) -> bool:
        return self.transport is not None and not self.broken and not self.transport.is_closing()

    def write(self, data: bytes) -> int:
        assert self.transport is not None
        if self.transport.get_write_buffer_size() + len(data) > MAX_STDIN_BUFFER:
            raise OpError(
                "failed_precondition",
                "the process has not read its earlier input (%d bytes waiting)" % self.transport.get_write_buffer_size(),
            )
        self.transport.write(data)
        return self.transport.get_write_buffer_size()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            # Flushes what is buffered, then closes: the process sees EOF.
            self.transport.close()


async def _open_stdin(pipe: Any) -> StdinPipe:
    loop = asyncio.get_running_loop()
    _, protocol = await loop.connect_write_pipe(StdinPipe, pipe)
    return protocol


async def _feed_stdin(pipe: Any, data: bytes) -> None:
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_write_pipe(asyncio.Protocol, pipe)
    # The transport buffers what the pipe cannot take yet and closes the pipe
    # once the buffer is flushed; a child that exits without reading is fine.
    transport.write(data)
    transport.close()


async def _wait_while_progressing(pumps: List["asyncio.Task[None]"], progress: List[int]) -> List["asyncio.Task[None]"]:
    """Waits for the output pumps while they keep making progress; returns
    those still open, which only a leftover background child holds."""
    pending = [p for p in pumps if not p.done()]
    last = -1
    while pending and progress[0] != last:
        last = progress[0]
        _, still = await asyncio.wait(pending, timeout=OUTPUT_IDLE_GRACE_S)
        pending = list(still)
    return pending


async def _drain_after_exit(pumps: List["asyncio.Task[None]"], progress: List[int]) -> None:
    """Waits for the output pumps while they keep making progress, then
    abandons pipes that only a leftover background child holds open."""
    pending = await _wait_while_progressing(pumps, progress)
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
        # Set when the process was started with ``stdin``: the pipe to it.
        self.stdin: Optional[StdinPipe] = None
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
                log("log write for %s failed: %s" % (self.process_id, exc))
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
            "stdin_open": self.stdin is not None and self.stdin.open,
        }

    def exit_frame(self) -> Json:
        return {
            "type": "exit",
            "exit_code": self.exit_code,
            "timed_out": False,
            "duration_ms": self.duration_ms,
        }


class Processes:
    """The ``exec`` and ``process.*`` ops, and the background processes they
    keep."""

    def __init__(self, workspace: Workspace, reaper: Reaper, procs_dir: str, ring_bytes: int) -> None:
        self.workspace = workspace
        self.reaper = reaper
        self.procs_dir = procs_dir
        self.ring_bytes = ring_bytes
        self.processes: Dict[str, ManagedProcess] = {}
        self._exec_ids = itertools.count(1)

    def handlers(self) -> Dict[str, Handler]:
        return {
            "exec": self._op_exec,
            "process.start": self._op_process_start,
            "process.attach": self._op_process_attach,
            "process.list": self._op_process_list,
            "process.wait": self._op_process_wait,
            "process.kill": self._op_process_kill,
            "process.write_stdin": self._op_process_write_stdin,
        }

    def running(self) -> int:
        return sum(1 for p in self.processes.values() if p.running)

    def kill_all(self) -> None:
        for proc in self.processes.values():
            if proc.running:
                proc.child.kill_tree(signal.SIGKILL)
        for child in self.reaper.live_children():
            child.kill_tree(signal.SIGKILL)

    def _spawn(self, req: Json, marker: str, stdin_pipe: bool) -> Child:
        argv = _command_argv(req)
        cwd = self.workspace.cwd(req)
        variables = dict(self.workspace.extra_env)
        variables.update(opt_env(req))
        return self.reaper.spawn(argv, cwd, self.workspace.command_env(variables), marker, stdin_pipe)

    async def _op_exec(self, conn: Sender, rid: int, req: Json) -> Json:
        timeout = opt_positive_float(req, "timeout_s")
        stdin_data = unb64(req["stdin_b64"], "stdin_b64") if req.get("stdin_b64") is not None else None
        marker = "exec_%d_%s" % (next(self._exec_ids), os.urandom(4).hex())
        try:
            child = self._spawn(req, marker, stdin_data is not None)
        except (FileNotFoundError, PermissionError) as exc:
            # Mirror a shell: a missing or non-executable command is an exit
            # status, not a protocol error.
            await conn.send({"id": rid, "type": "chunk", "stream": "stderr", "seq": 0, "data_b64": b64(("sandboxd: %s\n" % exc).encode())})
            code = 127 if isinstance(exc, FileNotFoundError) else 126
            return {"type": "exit", "exit_code": code, "timed_out": False, "duration_ms": 0}
        seq = itertools.count()
        progress = [0]

        def sender(stream: str) -> Callable[[bytes], Awaitable[None]]:
            async def send(data: bytes) -> None:
                await conn.send({"id": rid, "type": "chunk", "stream": stream, "seq": next(seq), "data_b64": b64(data)})

            return send

        pumps = [
            asyncio.ensure_future(pump_pipe(child.popen.stdout, sender("stdout"), progress)),
            asyncio.ensure_future(pump_pipe(child.popen.stderr, sender("stderr"), progress)),
        ]
        for pump in pumps:
            pump.add_done_callback(consume_result)
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

    def _process(self, req: Json) -> ManagedProcess:
        process_id = req_str(req, "process_id")
        proc = self.processes.get(process_id)
        if proc is None:
            raise OpError("not_found", "no process %s" % process_id)
        return proc

    async def _op_process_start(self, conn: Sender, rid: int, req: Json) -> Json:
        name = opt_str(req, "name") or ""
        keepalive = opt_bool(req, "keepalive", False)
        with_stdin = opt_bool(req, "stdin", False)
        if opt_bool(req, "by_name", False):
            if not name:
                raise OpError("invalid_argument", "by_name needs a name")
            for existing in self.processes.values():
                if existing.name == name:
                    # Started before (a caller whose answer was lost): no second run.
                    return existing.describe()
        process_id = "proc_" + os.urandom(8).hex()
        try:
            child = self._spawn(req, process_id, with_stdin)
        except FileNotFoundError as exc:
            raise OpError("not_found", str(exc)) from None
        except PermissionError as exc:
            raise OpError("permission_denied", str(exc)) from None
        log_path = os.path.join(self.procs_dir, process_id + ".log")
        proc = ManagedProcess(process_id, name, child, keepalive, log_path, self.ring_bytes)
        if with_stdin:
            proc.stdin = await _open_stdin(child.popen.stdin)
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
            asyncio.ensure_future(pump_pipe(proc.child.popen.stdout, recorder(1), progress)),
            asyncio.ensure_future(pump_pipe(proc.child.popen.stderr, recorder(2), progress)),
        ]
        for pump in pumps:
            pump.add_done_callback(consume_result)
        code = await proc.child.exited
        # Output already in the pipes belongs before the exit frame; whatever a
        # leftover child writes later is still recorded, after it.
        pending = await _wait_while_progressing(pumps, progress)
        if proc.stdin is not None:
            proc.stdin.close()
        proc.finish(code)
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        proc.close_log()

    def _forget_old_processes(self) -> None:
        exited = [p for p in self.processes.values() if not p.running]
        for proc in exited[: max(0, len(exited) - MAX_EXITED_PROCESSES)]:
            del self.processes[proc.process_id]

    async def _op_process_attach(self, conn: Sender, rid: int, req: Json) -> Json:
        proc = self._process(req)
        seq = max(0, opt_int(req, "from_seq", 0) or 0)
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
                        {"id": rid, "type": "chunk", "stream": _STREAM_NAMES[stream], "seq": rec_seq, "data_b64": b64(data)}
                    )
                    seq = rec_seq + 1
                continue
            if proc.finished.is_set():
                return proc.exit_frame()
            await changed.wait()

    async def _op_process_list(self, conn: Sender, rid: int, req: Json) -> Json:
        return {"processes": [p.describe() for p in self.processes.values()]}

    async def _op_process_wait(self, conn: Sender, rid: int, req: Json) -> Json:
        proc = self._process(req)
        timeout = opt_positive_float(req, "timeout_s")
        try:
            await asyncio.wait_for(proc.finished.wait(), timeout)
        except asyncio.TimeoutError:
            return {"running": True, "timed_out": True}
        frame = proc.exit_frame()
        frame["running"] = False
        return frame

    async def _op_process_kill(self, conn: Sender, rid: int, req: Json) -> Json:
        proc = self._process(req)
        sig = _parse_signal(req.get("signal"))
        signalled = proc.child.kill_tree(sig) if proc.running else 0
        if sig == signal.SIGKILL and proc.running:
            try:
                await asyncio.wait_for(proc.finished.wait(), 10)
            except asyncio.TimeoutError:
                pass
        return {"signalled": signalled, "running": proc.running, "exit_code": proc.exit_code}

    async def _op_process_write_stdin(self, conn: Sender, rid: int, req: Json) -> Json:
        """Writes ``data_b64`` to the process's stdin, then closes it when
        ``close`` is set (the process reads EOF). Returns how many bytes are
        still waiting for the process to read them."""
        proc = self._process(req)
        data = unb64(req["data_b64"], "data_b64") if req.get("data_b64") is not None else b""
        close = opt_bool(req, "close", False)
        pipe = proc.stdin
        if pipe is None:
            raise OpError("failed_precondition", "process %s was not started with stdin" % proc.process_id)
        if not pipe.open or not proc.running:
            raise OpError("failed_precondition", "the stdin of process %s is closed" % proc.process_id)
        buffered = pipe.write(data) if data else 0
        if close:
            pipe.close()
        return {"buffered": buffered, "process": proc.describe()}
