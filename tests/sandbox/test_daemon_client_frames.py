"""The host-side client reads frames with sandboxd's own protocol module, so
both ends agree on the framing and its limits."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from services.sandbox.daemon.sandboxd import protocol
from services.sandbox.daemon_client import MAX_FRAME_BYTES, PROTOCOL_VERSION, DaemonClient, DaemonUnavailable

Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def _fake_daemon(path: Path, answer: Answer) -> AsyncIterator[None]:
    """A unix socket that reads the client's hello, then runs ``answer``."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = await protocol.read_frame(reader)
        assert hello == {"op": "hello", "v": PROTOCOL_VERSION}
        try:
            await answer(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_unix_server(serve, str(path))
    try:
        yield
    finally:
        server.close()
        await server.wait_closed()


def _hello_then(frame: bytes) -> Answer:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(frame)
        await writer.drain()

    return answer


def test_the_client_shares_the_daemons_protocol_constants() -> None:
    assert PROTOCOL_VERSION == protocol.PROTOCOL_VERSION
    assert MAX_FRAME_BYTES == protocol.MAX_FRAME_BYTES


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(struct.pack(">I", MAX_FRAME_BYTES + 1), id="over the size limit"),
        pytest.param(struct.pack(">I", 10) + b"{", id="truncated"),
        pytest.param(struct.pack(">I", 2) + b"[]", id="not an object"),
        pytest.param(b"", id="closed before answering"),
    ],
)
async def test_a_bad_handshake_frame_makes_the_daemon_unavailable(tmp_path: Path, frame: bytes) -> None:
    path = tmp_path / "d.sock"
    async with _fake_daemon(path, _hello_then(frame)):
        client = DaemonClient(str(path), connect_timeout_s=5)
        with pytest.raises(DaemonUnavailable):
            await client.connect()
        await client.close()


async def test_a_daemon_that_drops_mid_frame_fails_the_request_in_flight(tmp_path: Path) -> None:
    path = tmp_path / "d.sock"
    welcome = protocol.encode_frame({"ok": True, "v": PROTOCOL_VERSION, "pid": 1})

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(welcome)
        await writer.drain()
        request = await protocol.read_frame(reader)
        assert request is not None and request["op"] == "ping"
        writer.write(protocol.encode_frame({"id": request["id"], "final": True, "ok": True})[:-3])
        await writer.drain()

    async with _fake_daemon(path, answer):
        client = DaemonClient(str(path), connect_timeout_s=5, request_timeout_s=5)
        try:
            with pytest.raises(DaemonUnavailable):
                await client.ping()
        finally:
            await client.close()
