"""An MCP server for the broker tests, written with the official ``mcp`` package.

``python test_server.py`` serves stdio; ``python test_server.py http PORT
[json] [--host HOST]`` serves streamable HTTP on HOST (default 127.0.0.1):PORT
at ``/mcp``, answering with SSE streams, or with plain JSON bodies given ``json``.
With ``MCP_REQUIRED_BEARER`` in its environment, an HTTP request without
``Authorization: Bearer <that value>`` is answered 401.
"""

from __future__ import annotations

import asyncio
import os
import sys
import warnings
from typing import Any

from mcp.server import MCPServer
from mcp.server.mcpserver import Context

# The tests use logging notifications and roots, which protocol 2026-07-28
# deprecates; the handshake versions still carry them.
warnings.simplefilter("ignore")

server = MCPServer("berth-test")
_initializes = 0


async def _count_initialize(ctx: Any, call_next: Any) -> Any:
    global _initializes
    if ctx.method == "initialize":
        _initializes += 1
    return await call_next(ctx)


server.middleware.append(_count_initialize)


@server.tool()
def reader() -> str:
    """The READER_VALUE this process was launched with."""
    return os.environ.get("READER_VALUE", "")


@server.tool()
def env(name: str) -> str:
    """One variable of this process's launch-time environment."""
    return os.environ.get(name, "<unset>")


@server.tool()
async def echo(text: str, delay_s: float = 0.0) -> str:
    """Returns ``text`` after ``delay_s`` seconds."""
    if delay_s:
        await asyncio.sleep(delay_s)
    return text


_rendezvous: dict[str, tuple[int, asyncio.Event]] = {}


@server.tool()
async def rendezvous(key: str, n: int, text: str, timeout_s: float = 20.0) -> str:
    """Returns ``text`` once ``n`` calls with this ``key`` are in flight at
    the same time; "timeout" if they never all were."""
    count, arrived = _rendezvous.get(key, (0, asyncio.Event()))
    _rendezvous[key] = (count + 1, arrived)
    if count + 1 >= n:
        arrived.set()
    try:
        await asyncio.wait_for(arrived.wait(), timeout_s)
    except asyncio.TimeoutError:
        return "timeout"
    return text


@server.tool()
def initialize_count() -> int:
    """How many initialize requests this process has seen."""
    return _initializes


@server.tool()
def pid() -> int:
    """This process's pid."""
    return os.getpid()


@server.tool()
async def announce(text: str, ctx: Context) -> str:
    """Sends ``text`` as a log notification before answering."""
    await ctx.info(text)
    return "announced"


@server.tool()
async def ask_roots(ctx: Context) -> str:
    """Asks the client for its roots (a server-to-client request)."""
    try:
        result = await ctx.request_context.session.list_roots()
    except Exception as exc:
        return "error: %s" % exc
    return ",".join(str(root.uri) for root in result.roots)


@server.tool()
def header(name: str, ctx: Context) -> str:
    """One header of the HTTP request that carried this call."""
    return (ctx.headers or {}).get(name, "<unset>")


def _serve_requiring_bearer(host: str, port: int, json_response: bool, expected: str) -> None:
    import uvicorn

    app = server.streamable_http_app(json_response=json_response, host=host)

    async def guarded(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            if headers.get(b"authorization", b"").decode() != expected:
                await send({"type": "http.response.start", "status": 401, "headers": [(b"content-length", b"0")]})
                await send({"type": "http.response.body", "body": b""})
                return
        await app(scope, receive, send)

    uvicorn.run(guarded, host=host, port=port, log_level="warning")


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "http":
        host = sys.argv[sys.argv.index("--host") + 1] if "--host" in sys.argv else "127.0.0.1"
        required = os.environ.get("MCP_REQUIRED_BEARER")
        if required:
            _serve_requiring_bearer(host, int(sys.argv[2]), "json" in sys.argv[3:], f"Bearer {required}")
        else:
            server.run("streamable-http", host=host, port=int(sys.argv[2]), json_response="json" in sys.argv[3:])
    else:
        server.run()
