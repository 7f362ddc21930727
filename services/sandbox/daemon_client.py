"""Async client for sandboxd, the in-sandbox daemon.

One persistent unix-socket connection carries every request, multiplexed by
request id, so a warm exec costs a round trip rather than a connect. The
connection is opened lazily and reopened after it drops. The wire protocol is
described in ``services/sandbox/daemon/sandboxd/__init__.py``; frames are
read and written by the daemon's own ``protocol`` module.

Streaming calls (``exec``, ``attach_process``, ``read_file``) are async
generators: closing one early (``aclose()``, ``contextlib.aclosing``, or
cancelling the task that iterates it) cancels the request in the daemon, which
kills an exec's whole process tree.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import os
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from services.sandbox.daemon.sandboxd.protocol import MAX_FRAME_BYTES, MAX_WRITE_BYTES, PROTOCOL_VERSION, ProtocolError, encode_frame, read_frame
from services.sandbox.states import McpBrokerState

__all__ = [
    "probe",
    "PROTOCOL_VERSION",
    "MAX_FRAME_BYTES",
    "MAX_WRITE_BYTES",
    "DaemonError",
    "DaemonUnavailable",
    "OutputChunk",
    "ExitStatus",
    "ExecResult",
    "ProcessInfo",
    "FileEntry",
    "McpStdioTransport",
    "McpHttpTransport",
    "McpTransport",
    "McpBrokerInfo",
    "McpUpstream",
    "DaemonClient",
]

# Leaves room under the ~108-byte sun_path limit for the NUL terminator.
_MAX_SOCKET_PATH = 100

_Frame = dict[str, Any]
_Item = _Frame | BaseException


class DaemonError(Exception):
    """The daemon refused or failed a request.

    ``code`` is one of ``not_found``, ``invalid_argument``,
    ``permission_denied``, ``failed_precondition`` or ``internal``;
    ``reason`` refines it where callers act on the cause (``mcp_server_dead``)
    and ``param`` names the offending field, when the daemon says.
    """

    def __init__(self, code: str, message: str, *, reason: str | None = None, param: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.reason = reason
        self.param = param


class DaemonUnavailable(Exception):
    """The daemon could not be reached, or the connection dropped mid-request."""


@dataclass(frozen=True)
class OutputChunk:
    stream: Literal["stdout", "stderr"]
    seq: int
    data: bytes


@dataclass(frozen=True)
class ExitStatus:
    """``exit_code`` is ``-signal`` for a command killed by a signal and 124
    for an exec killed by its timeout (then ``timed_out`` is true)."""

    exit_code: int
    timed_out: bool
    duration_ms: int


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    duration_ms: int


@dataclass(frozen=True)
class ProcessInfo:
    process_id: str
    name: str
    pid: int
    running: bool
    exit_code: int | None
    keepalive: bool
    started_at: float
    next_seq: int
    # Whether its stdin is a pipe still open for write_stdin.
    stdin_open: bool = False


FileType = Literal["file", "dir", "symlink", "other"]


@dataclass(frozen=True)
class FileEntry:
    path: str
    type: FileType
    size: int
    mode: int
    mtime: float


@dataclass(frozen=True)
class McpStdioTransport:
    """A stdio MCP server started inside the sandbox. ``env_vars`` names
    variables inherited from the sandbox's environment; ``env`` sets values."""

    command: str
    args: Sequence[str] = ()
    cwd: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    env_vars: Sequence[str] = ()

    def to_wire(self) -> _Frame:
        wire: _Frame = {"type": "stdio", "command": self.command, "args": list(self.args), "env": dict(self.env), "env_vars": list(self.env_vars)}
        if self.cwd:
            wire["cwd"] = self.cwd
        return wire


@dataclass(frozen=True)
class McpHttpTransport:
    """A streamable HTTP MCP server reached from the sandbox's network."""

    server_url: str
    headers: Mapping[str, str] = field(default_factory=dict)

    def to_wire(self) -> _Frame:
        return {"type": "http", "server_url": self.server_url, "headers": dict(self.headers)}


McpTransport = McpStdioTransport | McpHttpTransport


@dataclass(frozen=True)
class McpBrokerInfo:
    """A broker as the daemon reports it. ``created`` is set only by
    ``mcp_start``: whether this call created the broker. ``clients`` counts
    open subscriptions plus requests in flight."""

    label: str
    transport: Literal["stdio", "http"]
    state: McpBrokerState
    pid: int | None
    started_at: float
    exit_code: int | None
    clients: int
    in_flight: int
    stderr_tail: str
    created: bool = False


@dataclass(frozen=True)
class McpUpstream:
    """What ``mcp_upstream`` says of a label: its transport and state and,
    for HTTP, the first start's URL and headers and the proxy the sandbox's
    environment names for that URL."""

    transport: Literal["stdio", "http"]
    state: McpBrokerState
    server_url: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    proxy: str | None = None
    # The first client's initialize params, once remembered.
    init_params: dict[str, Any] | None = None


def _broker_info(raw: Mapping[str, Any]) -> McpBrokerInfo:
    pid, exit_code = raw.get("pid"), raw.get("exit_code")
    return McpBrokerInfo(
        label=str(raw["label"]),
        transport="http" if raw.get("transport") == "http" else "stdio",
        state=McpBrokerState.DEAD if raw.get("state") == McpBrokerState.DEAD else McpBrokerState.RUNNING,
        pid=None if pid is None else int(pid),
        started_at=float(raw.get("started_at", 0.0)),
        exit_code=None if exit_code is None else int(exit_code),
        clients=int(raw.get("clients", 0)),
        in_flight=int(raw.get("in_flight", 0)),
        stderr_tail=str(raw.get("stderr_tail", "")),
        created=bool(raw.get("created", False)),
    )


async def _read_frame(reader: asyncio.StreamReader) -> _Frame:
    try:
        frame = await read_frame(reader)
    except ProtocolError as exc:
        raise DaemonUnavailable(f"daemon sent a bad frame: {exc}") from exc
    if frame is None:
        raise DaemonUnavailable("the sandbox daemon closed the connection")
    return frame


def _raise_for_error(frame: _Frame) -> None:
    error = frame.get("error")
    if isinstance(error, dict):
        reason, param = error.get("reason"), error.get("param")
        raise DaemonError(
            str(error.get("code", "internal")),
            str(error.get("message", "")),
            reason=str(reason) if reason is not None else None,
            param=str(param) if param is not None else None,
        )


def _exit_status(frame: _Frame) -> ExitStatus:
    return ExitStatus(
        exit_code=int(frame["exit_code"]),
        timed_out=bool(frame.get("timed_out", False)),
        duration_ms=int(frame.get("duration_ms", 0)),
    )


def _output_chunk(frame: _Frame) -> OutputChunk:
    stream: Literal["stdout", "stderr"] = "stderr" if frame.get("stream") == "stderr" else "stdout"
    return OutputChunk(stream=stream, seq=int(frame["seq"]), data=base64.b64decode(frame["data_b64"]))


def _process_info(raw: Mapping[str, Any]) -> ProcessInfo:
    exit_code = raw.get("exit_code")
    return ProcessInfo(
        process_id=str(raw["process_id"]),
        name=str(raw.get("name", "")),
        pid=int(raw["pid"]),
        running=bool(raw.get("running", True)),
        exit_code=None if exit_code is None else int(exit_code),
        keepalive=bool(raw.get("keepalive", False)),
        started_at=float(raw.get("started_at", 0.0)),
        next_seq=int(raw.get("next_seq", 0)),
        stdin_open=bool(raw.get("stdin_open", False)),
    )


def _file_entry(raw: Mapping[str, Any]) -> FileEntry:
    kind = str(raw.get("type", "other"))
    return FileEntry(
        path=str(raw["path"]),
        type=cast(FileType, kind if kind in ("file", "dir", "symlink") else "other"),
        size=int(raw.get("size", 0)),
        mode=int(raw.get("mode", 0)),
        mtime=float(raw.get("mtime", 0.0)),
    )


def _command(argv: list[str] | None, shell: str | None, cwd: str | None, env: Mapping[str, str] | None) -> _Frame:
    if (argv is None) == (shell is None):
        raise ValueError("pass exactly one of argv and shell")
    fields: _Frame = {"argv": list(argv)} if argv is not None else {"shell": shell}
    if cwd is not None:
        fields["cwd"] = cwd
    if env:
        fields["env"] = dict(env)
    return fields


async def _open_unix(path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    if len(os.fsencode(path)) <= _MAX_SOCKET_PATH:
        return await asyncio.open_unix_connection(path, limit=1024 * 1024)
    # A host data dir can push the socket path past sun_path; connecting
    # through a /proc/self/fd alias of its directory keeps it short.
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        alias = f"/proc/self/fd/{dir_fd}/{os.path.basename(path)}"
        return await asyncio.open_unix_connection(alias, limit=1024 * 1024)
    finally:
        os.close(dir_fd)


async def _say_hello(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> _Frame:
    writer.write(encode_frame({"op": "hello", "v": PROTOCOL_VERSION}))
    await writer.drain()
    hello = await _read_frame(reader)
    if not hello.get("ok"):
        _raise_for_error(hello)
        raise DaemonUnavailable(f"unexpected handshake answer {hello!r}")
    return hello


class _Connection:
    """One open socket and the reader task that routes frames by request id."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hello: _Frame) -> None:
        self.reader = reader
        self.writer = writer
        self.hello = hello
        self.closed = False
        self._queues: dict[int, asyncio.Queue[_Item]] = {}
        self._drain_lock = asyncio.Lock()
        self._reader_task = asyncio.create_task(self._route())

    def register(self, rid: int) -> asyncio.Queue[_Item]:
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._queues[rid] = queue
        return queue

    def unregister(self, rid: int) -> None:
        self._queues.pop(rid, None)

    async def send(self, frame: _Frame) -> None:
        if self.closed:
            raise DaemonUnavailable("connection to the sandbox daemon is closed")
        try:
            self.writer.write(encode_frame(frame))
            async with self._drain_lock:
                await self.writer.drain()
        except (ConnectionError, RuntimeError) as exc:
            self._fail(DaemonUnavailable(f"connection to the sandbox daemon dropped: {exc}"))
            raise DaemonUnavailable(f"connection to the sandbox daemon dropped: {exc}") from exc

    def send_nowait(self, frame: _Frame) -> None:
        """For cancellation from finalizers, where awaiting is not possible."""
        if not self.closed and not self.writer.is_closing():
            self.writer.write(encode_frame(frame))

    async def _route(self) -> None:
        try:
            while True:
                frame = await _read_frame(self.reader)
                rid = frame.get("id")
                queue = self._queues.get(rid) if isinstance(rid, int) else None
                if queue is not None:
                    queue.put_nowait(frame)
        except asyncio.CancelledError:
            self._fail(DaemonUnavailable("connection to the sandbox daemon was closed"))
            raise
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ValueError, DaemonUnavailable) as exc:
            self._fail(DaemonUnavailable(f"connection to the sandbox daemon dropped: {exc!r}"))

    def _fail(self, error: DaemonUnavailable) -> None:
        if self.closed:
            return
        self.closed = True
        for queue in self._queues.values():
            queue.put_nowait(error)
        self._queues.clear()
        self.writer.close()

    async def close(self) -> None:
        self._reader_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader_task
        self._fail(DaemonUnavailable("client closed"))
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.wait_closed()


class DaemonClient:
    def __init__(
        self,
        socket_path: str,
        *,
        connect_timeout_s: float = 5.0,
        request_timeout_s: float = 60.0,
    ) -> None:
        """``request_timeout_s`` bounds each non-streaming request, so a
        frozen or wedged sandbox surfaces as DaemonUnavailable."""
        self.socket_path = socket_path
        self._connect_timeout_s = connect_timeout_s
        self._request_timeout_s = request_timeout_s
        self._conn: _Connection | None = None
        self._connect_lock = asyncio.Lock()
        self._ids = itertools.count(1)

    @property
    def hello(self) -> Mapping[str, Any]:
        """The daemon's handshake answer (pid, workspace, root, isolation)."""
        if self._conn is None:
            raise DaemonUnavailable("not connected")
        return self._conn.hello

    async def __aenter__(self) -> DaemonClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def connect(self) -> None:
        await self._connection()

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()

    async def _connection(self) -> _Connection:
        conn = self._conn
        if conn is not None and not conn.closed:
            return conn
        async with self._connect_lock:
            if self._conn is not None and not self._conn.closed:
                return self._conn
            try:
                self._conn = await asyncio.wait_for(self._handshake(), self._connect_timeout_s)
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                raise DaemonUnavailable(f"cannot connect to sandbox daemon at {self.socket_path}: {exc!r}") from exc
            except TimeoutError as exc:
                raise DaemonUnavailable(f"timed out connecting to sandbox daemon at {self.socket_path}") from exc
            return self._conn

    async def _handshake(self) -> _Connection:
        reader, writer = await _open_unix(self.socket_path)
        try:
            hello = await _say_hello(reader, writer)
        except BaseException:
            writer.close()
            raise
        return _Connection(reader, writer, hello)


    # ------------------------------------------------------------ plumbing

    async def _stream(self, op: str, fields: _Frame) -> AsyncGenerator[_Frame, None]:
        """Yields every frame of one request, the final one included."""
        conn = await self._connection()
        rid = next(self._ids)
        queue = conn.register(rid)
        finished = False
        try:
            await conn.send({"id": rid, "op": op, **fields})
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.get("final"):
                    finished = True
                    _raise_for_error(item)
                    yield item
                    return
                yield item
        finally:
            conn.unregister(rid)
            if not finished:
                conn.send_nowait({"op": "cancel", "target": rid})

    async def _request(self, op: str, fields: _Frame | None = None, *, timeout_s: float | None = None) -> _Frame:
        deadline = self._request_timeout_s if timeout_s is None else timeout_s

        async def first_final() -> _Frame:
            stream = self._stream(op, fields or {})
            try:
                async for frame in stream:
                    if frame.get("final"):
                        return frame
            finally:
                await stream.aclose()
            raise DaemonUnavailable(f"{op} ended without a final frame")

        try:
            return await asyncio.wait_for(first_final(), deadline)
        except TimeoutError as exc:
            raise DaemonUnavailable(f"sandbox daemon did not answer {op} within {deadline}s") from exc

    # ------------------------------------------------------------ general

    async def ping(self) -> dict[str, object]:
        frame = await self._request("ping")
        return {k: v for k, v in frame.items() if k not in ("id", "final")}

    async def shutdown(self) -> None:
        """Kills every process in the sandbox and stops the daemon."""
        await self._request("shutdown")
        await self.close()

    async def reload_env(self, *, dormant_after_s: float | None = None) -> int:
        """Makes the daemon re-read its environment file for the commands it
        starts from now on (and, if given, go dormant after
        ``dormant_after_s`` idle from now on, 0 never); returns how many
        extra variables it holds."""
        frame = await self._request("env.reload", {} if dormant_after_s is None else {"dormant_after_s": dormant_after_s})
        return int(frame.get("variables", 0))

    async def start_egress_relay(self, port: int, socket_path: str) -> int:
        """Makes the daemon relay TCP connections to ``127.0.0.1:port`` in the
        sandbox to the unix socket ``socket_path`` (the sandbox's egress
        proxy); idempotent. Returns the port listened on (``port`` 0 picks
        one)."""
        frame = await self._request("egress.relay", {"port": port, "socket": socket_path})
        return int(frame["port"])

    # ------------------------------------------------------------ exec

    async def exec(
        self,
        *,
        argv: list[str] | None = None,
        shell: str | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        stdin: bytes | None = None,
    ) -> AsyncGenerator[OutputChunk | ExitStatus, None]:
        """Streams a command's output chunks, then its ExitStatus."""
        fields = _command(argv, shell, cwd, env)
        if timeout_s is not None:
            fields["timeout_s"] = timeout_s
        if stdin is not None:
            fields["stdin_b64"] = base64.b64encode(stdin).decode()
        stream = self._stream("exec", fields)
        try:
            async for frame in stream:
                if frame.get("type") == "chunk":
                    yield _output_chunk(frame)
                elif frame.get("type") == "exit":
                    yield _exit_status(frame)
        finally:
            await stream.aclose()

    async def run(
        self,
        *,
        argv: list[str] | None = None,
        shell: str | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        """Runs a command to completion and collects its output."""
        stdout: list[bytes] = []
        stderr: list[bytes] = []
        status: ExitStatus | None = None
        stream = self.exec(argv=argv, shell=shell, cwd=cwd, env=env, timeout_s=timeout_s, stdin=stdin)
        try:
            async for item in stream:
                if isinstance(item, OutputChunk):
                    (stdout if item.stream == "stdout" else stderr).append(item.data)
                else:
                    status = item
        finally:
            await stream.aclose()
        if status is None:
            raise DaemonUnavailable("exec ended without an exit status")
        return ExecResult(
            exit_code=status.exit_code,
            stdout=b"".join(stdout),
            stderr=b"".join(stderr),
            timed_out=status.timed_out,
            duration_ms=status.duration_ms,
        )

    # ------------------------------------------------------------ background processes

    async def start_process(
        self,
        *,
        name: str = "",
        argv: list[str] | None = None,
        shell: str | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        keepalive: bool = False,
        stdin: bool = False,
        by_name: bool = False,
    ) -> ProcessInfo:
        """Starts a process that outlives this request and this connection.
        With ``stdin`` its stdin is a pipe that ``write_stdin`` writes to;
        otherwise it reads /dev/null. With ``by_name`` (and a ``name``), a
        process of that name the daemon knows is returned and nothing starts."""
        fields = _command(argv, shell, cwd, env)
        fields.update(name=name, keepalive=keepalive)
        if stdin:
            fields["stdin"] = True
        if by_name:
            fields["by_name"] = True
        frame = await self._request("process.start", fields)
        if "running" in frame:
            # An existing process, as process.list describes it.
            return _process_info(frame)
        return ProcessInfo(
            process_id=str(frame["process_id"]),
            name=str(frame.get("name", name)),
            pid=int(frame["pid"]),
            running=True,
            exit_code=None,
            keepalive=bool(frame.get("keepalive", keepalive)),
            started_at=float(frame.get("started_at", 0.0)),
            next_seq=0,
            stdin_open=stdin,
        )

    async def attach_process(self, process_id: str, from_seq: int = 0) -> AsyncGenerator[OutputChunk | ExitStatus, None]:
        """Replays output from ``from_seq`` on, follows live output, and ends
        with the ExitStatus once the process has exited."""
        stream = self._stream("process.attach", {"process_id": process_id, "from_seq": from_seq})
        try:
            async for frame in stream:
                if frame.get("type") == "chunk":
                    yield _output_chunk(frame)
                elif frame.get("type") == "exit":
                    yield _exit_status(frame)
        finally:
            await stream.aclose()

    async def list_processes(self) -> list[ProcessInfo]:
        frame = await self._request("process.list")
        return [_process_info(raw) for raw in frame.get("processes", [])]

    async def wait_process(self, process_id: str, timeout_s: float) -> ExitStatus | None:
        """The exit status, or None if the process still runs after ``timeout_s``."""
        frame = await self._request(
            "process.wait",
            {"process_id": process_id, "timeout_s": timeout_s},
            timeout_s=timeout_s + self._request_timeout_s,
        )
        if frame.get("running"):
            return None
        return _exit_status(frame)

    async def kill_process(self, process_id: str, signal: int = 9) -> ProcessInfo | None:
        """Signals the process's whole tree, including children that escaped
        into their own session. With SIGKILL it returns once the process has
        exited; returns the process as it is afterwards."""
        await self._request("process.kill", {"process_id": process_id, "signal": signal})
        for info in await self.list_processes():
            if info.process_id == process_id:
                return info
        return None

    async def write_stdin(self, process_id: str, data: bytes, *, close: bool = False) -> ProcessInfo:
        """Writes ``data`` to the stdin of a process started with ``stdin``,
        then closes it when ``close`` is set; returns the process."""
        if len(data) > MAX_WRITE_BYTES:
            raise ValueError(f"write_stdin takes at most {MAX_WRITE_BYTES} bytes per call")
        fields: _Frame = {"process_id": process_id, "data_b64": base64.b64encode(data).decode(), "close": close}
        frame = await self._request("process.write_stdin", fields)
        return _process_info(frame["process"])

    # ------------------------------------------------------------ files

    async def write_file(self, path: str, data: bytes, *, mode: int | None = None, append: bool = False) -> int:
        """Writes atomically (temp file, fsync, rename) unless appending;
        returns the file's size. At most MAX_WRITE_BYTES per call."""
        if len(data) > MAX_WRITE_BYTES:
            raise ValueError(f"write_file takes at most {MAX_WRITE_BYTES} bytes per call")
        fields: _Frame = {"path": path, "data_b64": base64.b64encode(data).decode(), "append": append}
        if mode is not None:
            fields["mode"] = mode
        frame = await self._request("file.write", fields)
        return int(frame["size"])

    async def read_file(self, path: str, *, offset: int = 0, length: int | None = None) -> AsyncGenerator[bytes, None]:
        """Streams the file in chunks of at most 1 MiB."""
        fields: _Frame = {"path": path, "offset": offset}
        if length is not None:
            fields["length"] = length
        stream = self._stream("file.read", fields)
        try:
            async for frame in stream:
                if frame.get("type") == "chunk":
                    yield base64.b64decode(frame["data_b64"])
        finally:
            await stream.aclose()

    async def read_file_bytes(self, path: str) -> bytes:
        parts: list[bytes] = []
        stream = self.read_file(path)
        try:
            async for part in stream:
                parts.append(part)
        finally:
            await stream.aclose()
        return b"".join(parts)

    async def list_files(self, path: str = "/workspace", recursive: bool = False) -> list[FileEntry]:
        frame = await self._request("file.list", {"path": path, "recursive": recursive})
        return [_file_entry(raw) for raw in frame.get("entries", [])]

    async def stat(self, path: str) -> FileEntry:
        """Describes the path itself; a symlink is reported, not followed."""
        frame = await self._request("file.stat", {"path": path})
        return _file_entry(frame["entry"])

    async def mkdir(self, path: str, parents: bool = True) -> None:
        await self._request("file.mkdir", {"path": path, "parents": parents})

    async def remove(self, path: str, recursive: bool = False) -> None:
        await self._request("file.remove", {"path": path, "recursive": recursive})

    # ------------------------------------------------------------ MCP brokers

    async def mcp_start(self, label: str, transport: McpTransport | None) -> McpBrokerInfo:
        """Starts the label's broker, or returns the existing one (running or
        dead) untouched; ``created`` tells which. Without a transport it only
        joins an existing broker."""
        frame = await self._request("mcp.start", {"label": label, "transport": None if transport is None else transport.to_wire()})
        return _broker_info(frame)

    async def mcp_request(self, label: str, message: Mapping[str, Any], *, timeout_s: float | None = None) -> dict[str, Any]:
        """Sends one JSON-RPC request through the broker and returns its
        response, with the caller's id. A dead broker raises DaemonError
        with reason ``mcp_server_dead``."""
        frame = await self._request("mcp.request", {"label": label, "message": dict(message)}, timeout_s=timeout_s)
        return cast(dict[str, Any], frame["message"])

    async def mcp_notify(self, label: str, message: Mapping[str, Any]) -> bool:
        """Sends a notification, or the answer to a server request; returns
        whether it went upstream (a repeated ``notifications/initialized``
        does not)."""
        frame = await self._request("mcp.notify", {"label": label, "message": dict(message)})
        return bool(frame.get("forwarded", False))

    @asynccontextmanager
    async def mcp_subscribe(self, label: str) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """Registers for the broker's server messages; entering returns once
        registered, so nothing sent afterwards is missed. Iterating yields
        notifications and the server requests this subscriber must answer
        (with ``mcp_notify``); it ends when the broker dies."""
        stream = self._stream("mcp.subscribe", {"label": label})
        try:
            first = await anext(stream)

            async def messages() -> AsyncIterator[dict[str, Any]]:
                if first.get("final"):
                    return
                async for frame in stream:
                    if frame.get("type") == "message":
                        yield cast(dict[str, Any], frame["message"])

            yield messages()
        finally:
            await stream.aclose()

    async def mcp_list(self) -> list[McpBrokerInfo]:
        frame = await self._request("mcp.list")
        return [_broker_info(raw) for raw in frame.get("brokers", [])]

    async def mcp_stop(self, label: str) -> McpBrokerInfo:
        """Kills a stdio server's process tree (an HTTP label's upstream
        session is the Sandbox service's to end); the broker stays, dead."""
        frame = await self._request("mcp.stop", {"label": label})
        return _broker_info(frame)

    async def mcp_close_upstream(self, label: str) -> bool:
        """Ends a broker's upstream session in the daemon; always False
        since HTTP upstreams live in the Sandbox service (``mcp_http``)."""
        frame = await self._request("mcp.close_upstream", {"label": label})
        return bool(frame.get("closed", False))

    async def mcp_upstream(self, label: str) -> McpUpstream:
        """The label's registration: for HTTP, whom the Sandbox service's
        client connects to."""
        frame = await self._request("mcp.upstream", {"label": label})
        headers = frame.get("headers")
        proxy = frame.get("proxy")
        return McpUpstream(
            transport="http" if frame.get("transport") == "http" else "stdio",
            state=McpBrokerState.DEAD if frame.get("state") == McpBrokerState.DEAD else McpBrokerState.RUNNING,
            server_url=str(frame.get("server_url") or ""),
            headers={str(k): str(v) for k, v in headers.items()} if isinstance(headers, dict) else {},
            proxy=str(proxy) if proxy else None,
            init_params=cast(dict[str, Any], frame["init_params"]) if isinstance(frame.get("init_params"), dict) else None,
        )

    async def mcp_remember_handshake(self, label: str, params: Mapping[str, Any]) -> None:
        """Records an HTTP label's first initialize params in the daemon."""
        await self._request("mcp.remember_handshake", {"label": label, "params": dict(params)})

    # ------------------------------------------------------------ tunnels

    async def open_tunnel(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A TCP connection to ``host:port`` opened by the daemon inside the
        sandbox (``net.connect``), under the sandbox's network policy: a new
        daemon connection that carries the stream's bytes once the daemon
        answers. Raises DaemonError (reason ``connect_failed``) when the
        sandbox cannot reach the target."""
        try:
            reader, writer = await asyncio.wait_for(_open_unix(self.socket_path), self._connect_timeout_s)
        except OSError as exc:
            raise DaemonUnavailable(f"cannot connect to sandbox daemon at {self.socket_path}: {exc!r}") from exc
        try:
            # Both frames at once: the daemon reads the request after its hello.
            writer.write(encode_frame({"op": "hello", "v": PROTOCOL_VERSION}))
            writer.write(encode_frame({"id": 1, "op": "net.connect", "host": host, "port": port}))
            await writer.drain()
            hello = await asyncio.wait_for(_read_frame(reader), self._connect_timeout_s)
            if not hello.get("ok"):
                _raise_for_error(hello)
                raise DaemonUnavailable(f"unexpected handshake answer {hello!r}")
            # The daemon's own connect is bounded by its timeout (30 s).
            answer = await asyncio.wait_for(_read_frame(reader), self._connect_timeout_s + 30.0)
            _raise_for_error(answer)
            if not answer.get("ok"):
                raise DaemonUnavailable(f"unexpected net.connect answer {answer!r}")
        except BaseException:
            writer.close()
            raise
        return reader, writer


async def probe(socket_path: str) -> Exception | None:
    """Whether a daemon answers on ``socket_path``: None when it does, else
    the reason it did not (for a start-up error message)."""
    if not os.path.exists(socket_path):
        return DaemonUnavailable(f"no socket at {socket_path}")
    client = DaemonClient(socket_path, connect_timeout_s=1.0, request_timeout_s=2.0)
    try:
        await client.ping()
        return None
    except (DaemonUnavailable, DaemonError) as exc:
        return exc
    finally:
        await client.close()
