"""An MCP server process in the sandbox, speaking newline-delimited
JSON-RPC on its stdin and stdout."""

from __future__ import annotations

import asyncio
import collections
import json
import signal
from typing import Any, Deque, List, Optional

from ..processes import OUTPUT_IDLE_GRACE_S, Child, consume_result, pump_pipe
from ..protocol import Json, log
from .broker import MCP_MAX_LINE_BYTES, McpBroker

MCP_STDERR_TAIL_BYTES = 4096


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
        self._supervisor.add_done_callback(consume_result)

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
            log("MCP server %s: cannot open its stdin: %r" % (self.label, exc))
            self.child.kill_tree(signal.SIGKILL)
        finally:
            self._ready.set()
        reader = asyncio.ensure_future(self._read_stdout(popen.stdout))
        stderr = asyncio.ensure_future(pump_pipe(popen.stderr, self._keep_stderr, [0]))
        stderr.add_done_callback(consume_result)
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
                    log("MCP server %s wrote a line over %d bytes; dropped" % (self.label, MCP_MAX_LINE_BYTES))
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
