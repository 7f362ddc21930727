"""The daemon: its socket, its connections, and the ops no concern owns
(``ping``, ``shutdown``, ``env.reload``)."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import socket
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Set

from .dormant import dormant_argv
from .files import Files
from .listen import bind_unix_socket
from .mcp import Mcp
from .processes import Processes, Reaper
from .protocol import (
    PROTOCOL_VERSION,
    Handler,
    Json,
    OpError,
    ProtocolError,
    Sender,
    encode_frame,
    log,
    opt_non_negative_float,
    read_frame,
)
from .relay import Relays, tunnel
from .workspace import VIRTUAL_ROOT, Workspace


class Connection:
    """One client connection: the handshake, then concurrent requests."""

    def __init__(self, daemon: "Daemon", reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.daemon = daemon
        self.reader = reader
        self.writer = writer
        self.tasks: Dict[int, "asyncio.Task[None]"] = {}
        # Past its hello, and not a tunnel: a dormant daemon may keep it.
        self.ready = False
        self.tunnel = False
        # Python 3.9 asserts on concurrent drain() calls, so drains take turns.
        self._drain_lock = asyncio.Lock()

    async def send(self, frame: Json) -> None:
        if self.writer.is_closing():
            raise ConnectionResetError("client went away")
        # One write() call per frame keeps concurrent senders from interleaving.
        self.writer.write(encode_frame(frame))
        async with self._drain_lock:
            await self.writer.drain()

    def quiescent(self) -> bool:
        """No request in flight and no frame half read or half written."""
        # StreamReader has no public view of what it buffered; without one,
        # the connection never counts as quiescent.
        buffered = getattr(self.reader, "_buffer", None)
        transport = self.writer.transport
        return (
            self.ready
            and not self.tunnel
            and not self.tasks
            and buffered is not None
            and len(buffered) == 0
            and not self.writer.is_closing()
            and transport.get_write_buffer_size() == 0
        )

    def fileno(self) -> int:
        sock = self.writer.get_extra_info("socket")
        return int(sock.fileno())

    async def serve(self, resumed: bool = False) -> None:
        try:
            if resumed or await self._handshake():
                self.ready = True
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
            if op == "net.connect":
                if self.tasks:
                    await self.send({"id": rid, "final": True, "error": {"code": "invalid_argument", "message": "net.connect must be a connection's first request"}})
                    continue
                # The connection becomes the tunnel: no frames after the answer.
                self.tunnel = True
                await tunnel(rid, frame, self.reader, self.writer)
                return
            if rid in self.tasks:
                await self.send({"id": rid, "final": True, "error": {"code": "invalid_argument", "message": "request id %d is in use" % rid}})
                continue
            self.daemon.touch()
            task = asyncio.ensure_future(self._run(rid, op, frame))
            self.tasks[rid] = task
            task.add_done_callback(functools.partial(self._forget, rid))

    def _forget(self, rid: int, task: "asyncio.Task[None]") -> None:
        self.daemon.touch()
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
            log("op %r failed: %r" % (op, exc))
            await self._send_quietly({"id": rid, "final": True, "error": {"code": "internal", "message": repr(exc)}})

    async def _send_quietly(self, frame: Json) -> None:
        try:
            await self.send(frame)
        except ConnectionError:
            pass


# ---------------------------------------------------------------- the daemon


class Daemon:
    """One unix socket serving the ops of every concern (processes, files,
    MCP brokers, the egress relay) over the sandbox's workspace."""

    def __init__(
        self,
        socket_path: str,
        workspace: str,
        state_dir: str,
        isolation: str,
        extra_env: Dict[str, str],
        ring_bytes: int,
        env_loader: Optional[Callable[[], Dict[str, str]]] = None,
        dormant_after_s: float = 0.0,
        resume_fds: Optional[List[int]] = None,
    ) -> None:
        """``dormant_after_s`` > 0 makes the daemon go dormant (``dormant``)
        after that long idle; ``resume_fds`` (the listening socket, then
        the connections) are what a dormant daemon hands back on waking."""
        self.socket_path = socket_path
        self.workspace = Workspace(workspace, extra_env, env_loader)
        self.root = self.workspace.root
        self.state_dir = state_dir
        self.isolation = isolation
        self.connections: Set[Connection] = set()
        self._stop: Optional[asyncio.Event] = None
        self.reaper = Reaper()
        self.processes = Processes(self.workspace, self.reaper, os.path.join(state_dir, "procs"), ring_bytes)
        self.files = Files(self.workspace)
        self.mcp = Mcp(self.workspace, self.reaper)
        self.relays = Relays()
        self.dormant_after_s = dormant_after_s
        self.resume_fds = resume_fds
        self._last_active = time.monotonic()
        self._listener: Optional[socket.socket] = None
        self._watcher: "Optional[asyncio.Task[None]]" = None
        self.handlers: Dict[str, Handler] = {
            "ping": self._op_ping,
            "shutdown": self._op_shutdown,
            "env.reload": self._op_env_reload,
            **self.processes.handlers(),
            **self.files.handlers(),
            **self.mcp.handlers(),
            **self.relays.handlers(),
        }

    # ------------------------------------------------------------ lifecycle

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.reaper.install(loop)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        os.makedirs(self.processes.procs_dir, exist_ok=True)
        os.makedirs(self.root, exist_ok=True)
        if self.resume_fds:
            sock = _adopt_socket(self.resume_fds[0])
        else:
            sock = _adopt_socket(bind_unix_socket(self.socket_path))
        self._listener = sock
        server = await asyncio.start_unix_server(self._on_connection, sock=sock, limit=_READ_LIMIT)
        for fd in (self.resume_fds or [])[1:]:
            reader, writer = await asyncio.open_unix_connection(sock=_adopt_socket(fd), limit=_READ_LIMIT)
            asyncio.ensure_future(self._serve_connection(Connection(self, reader, writer), resumed=True))
        self.set_dormant_after(self.dormant_after_s)
        pid_file = os.path.join(self.state_dir, "sandboxd.pid")
        with open(pid_file, "w") as handle:
            handle.write("%d\n" % os.getpid())
        if not self.resume_fds:
            log("listening on %s (workspace %s, isolation %s)" % (self.socket_path, self.root, self.isolation))
        try:
            await self._stop.wait()
        finally:
            if self._watcher is not None:
                self._watcher.cancel()
            server.close()
            self.relays.close()
            self._kill_all()
            for conn in list(self.connections):
                conn.writer.close()
            for path in (pid_file, self.socket_path):
                try:
                    os.unlink(path)
                except OSError:
                    pass

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._serve_connection(Connection(self, reader, writer), resumed=False)

    async def _serve_connection(self, conn: Connection, resumed: bool) -> None:
        self.touch()
        self.connections.add(conn)
        try:
            await conn.serve(resumed)
        finally:
            self.connections.discard(conn)
            self.touch()

    # ------------------------------------------------------------ dormancy

    def touch(self) -> None:
        self._last_active = time.monotonic()

    def dormant_ready(self) -> bool:
        """Nothing would be lost by becoming dormant now: no process (the
        kernel's list of this process's children, orphans adopted as PID 1
        included), no MCP broker, relay or tunnel, no record of an exited
        background process, and every connection quiescent."""
        if self.processes.processes or self.reaper.live_children() or self.mcp.brokers or self.relays.egress_relay:
            return False
        if not all(conn.quiescent() for conn in self.connections):
            return False
        pid = os.getpid()
        try:
            with open("/proc/%d/task/%d/children" % (pid, pid)) as handle:
                return not handle.read().strip()
        except OSError:
            return False

    def set_dormant_after(self, seconds: float) -> None:
        """Goes dormant after ``seconds`` idle from now on (0: never)."""
        self.dormant_after_s = seconds
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        if seconds > 0:
            self._watcher = asyncio.ensure_future(self._watch_idle())

    async def _watch_idle(self) -> None:
        interval = min(max(self.dormant_after_s / 4, 0.01), 5.0)
        while True:
            await asyncio.sleep(interval)
            if time.monotonic() - self._last_active >= self.dormant_after_s and self.dormant_ready():
                self._go_dormant()
                return

    def _go_dormant(self) -> None:
        """Becomes the dormant daemon; returns only if that fails."""
        assert self._listener is not None
        fds = [self._listener.fileno()] + [conn.fileno() for conn in self.connections]
        for fd in fds:
            os.set_inheritable(fd, True)
        sys.stderr.flush()
        argv = dormant_argv(fds, self.dormant_after_s)
        try:
            os.execv(argv[0], argv)
        except OSError as exc:  # the daemon stays as it is, only heavier
            for fd in fds:
                os.set_inheritable(fd, False)
            log("cannot go dormant: %r" % (exc,))

    def _kill_all(self) -> None:
        self.mcp.kill_all()
        self.processes.kill_all()

    # ------------------------------------------------------------ misc ops

    async def _op_ping(self, conn: Sender, rid: int, req: Json) -> Json:
        return {"ok": True, "pid": os.getpid(), "processes": self.processes.running()}

    async def _op_env_reload(self, conn: Sender, rid: int, req: Json) -> Json:
        # A warm pool's daemon learns its sandbox's idle period here too.
        dormant_after = opt_non_negative_float(req, "dormant_after_s")
        variables = self.workspace.reload()
        if dormant_after is not None:
            self.set_dormant_after(dormant_after)
        return {"ok": True, "variables": variables}

    async def _op_shutdown(self, conn: Sender, rid: int, req: Json) -> Json:
        self._kill_all()
        assert self._stop is not None
        # Let the final frame go out before the server stops.
        asyncio.get_running_loop().call_soon(self._stop.set)
        return {"ok": True}


_READ_LIMIT = 1024 * 1024


def _adopt_socket(fd: int) -> socket.socket:
    """A socket handed over by a dormant daemon; commands never inherit it."""
    os.set_inheritable(fd, False)
    sock = socket.socket(fileno=fd)
    sock.setblocking(False)
    return sock
