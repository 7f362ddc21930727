"""An MCP server reached over streamable HTTP from the sandbox's network."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from ..protocol import Json, OpError, log
from .broker import MCP_MAX_LINE_BYTES, McpBroker, jsonrpc_error

# Idle bound of one upstream HTTP read (a tool call streaming nothing for
# this long fails); each upstream POST runs on its own thread.
MCP_HTTP_TIMEOUT_S = 300.0
# JSON-RPC error code of a request the HTTP upstream never answered.
MCP_UPSTREAM_ERROR = -32000


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
            future.set_result(jsonrpc_error(upstream_id, MCP_UPSTREAM_ERROR, message, {"http_status": status}))

    async def _send(self, msg: Json) -> None:
        if self.dead:
            raise self.dead_error()
        if not self._upstream_ready and self._init_result is not None:
            try:
                await self._reinitialize()
            except OpError as exc:
                # Notifications are fire-and-forget; the next request reports it.
                log(exc.message)
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


def proxies_for(url: str, env: Dict[str, str]) -> Dict[str, str]:
    """The proxy settings in the sandbox's environment ``env`` that apply to
    ``url``, so HTTP brokers reach the network as the sandbox's own commands
    do."""
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
