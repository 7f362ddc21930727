"""MCP brokers: the ``mcp.*`` ops.

One broker per ``label`` per sandbox multiplexes every client of an
environment-origin MCP server onto one upstream. A stdio server process runs
here, in the sandbox. A streamable HTTP endpoint is only registered here:
its client runs in the Sandbox service, which reaches the server through
``net.connect`` tunnels this daemon opens from the sandbox's network (see
``relay``), and ``mcp.upstream {label}`` hands it the registration
(``{transport, server_url, headers, proxy, state, init_params}``; ``proxy``
is the one the sandbox's proxy variables name for the URL, or null).
``mcp.remember_handshake {label, params}`` records the first client's
``initialize`` params there, which a restarted Sandbox service replays to
open a session for callers that initialized before it restarted.

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

The client side of a stdio broker is one-shot: every ``mcp.request {label,
message}`` is its own client. The broker rewrites the request's id to a
broker-wide integer and back, so concurrent callers may reuse ids; the
final frame carries the response as ``message``. ``mcp.notify {label,
message}`` sends a notification, or the answer to a server request.
``mcp.subscribe {label}`` streams ``{"type": "subscribed"}`` once
registered, then ``{"type": "message", "message"}`` for every server
notification (to all subscribers) and server request (to the oldest
subscriber only, which answers it with ``mcp.notify``; with none, the broker
answers ``ping`` and fails other server requests with -32601); it ends when
the broker dies. The first ``initialize`` goes upstream and its result is
cached; later ones are answered from the cache with their own id, and a
``notifications/initialized`` is forwarded only once per upstream
handshake. A client ``notifications/cancelled`` is dropped (its id is
ambiguous); cancelling the ``mcp.request`` itself sends the server a
cancellation for the rewritten id. These three ops on an HTTP label fail
with ``failed_precondition``: the Sandbox service's broker (built on the
same ``broker`` module) does all of this for it.

``mcp.list`` returns ``{"brokers": [{label, transport, state: "running" |
"dead", pid, started_at, exit_code, clients, in_flight, stderr_tail}]}``.
``mcp.stop {label}`` kills a stdio server's process tree (an HTTP label's
upstream session is ended by the Sandbox service) and leaves the broker
dead. Requests to a dead broker fail with ``failed_precondition`` and
reason ``mcp_server_dead``; an unknown label is ``not_found``.
``mcp.close_upstream {label}`` answers ``{"closed": false}``: only HTTP
upstreams have a session to close, and those live in the Sandbox service.
"""

from __future__ import annotations

import os
from typing import Any, Dict

from ..processes import Reaper
from ..protocol import Handler, Json, OpError, Sender, opt_env, req_str, str_dict, str_list
from ..workspace import Workspace
from .broker import McpBroker, is_notification, is_request, is_response, mcp_label, mcp_message
from .stdio import StdioBroker
from .http import HttpEndpoint, proxy_for


class Mcp:
    """The ``mcp.*`` ops: one broker per label, never restarted."""

    def __init__(self, workspace: Workspace, reaper: Reaper) -> None:
        self.workspace = workspace
        self.reaper = reaper
        self.brokers: Dict[str, McpBroker] = {}

    def handlers(self) -> Dict[str, Handler]:
        return {
            "mcp.start": self._op_mcp_start,
            "mcp.request": self._op_mcp_request,
            "mcp.notify": self._op_mcp_notify,
            "mcp.subscribe": self._op_mcp_subscribe,
            "mcp.list": self._op_mcp_list,
            "mcp.stop": self._op_mcp_stop,
            "mcp.close_upstream": self._op_mcp_close_upstream,
            "mcp.upstream": self._op_mcp_upstream,
            "mcp.remember_handshake": self._op_mcp_remember_handshake,
        }

    def kill_all(self) -> None:
        for broker in self.brokers.values():
            broker.kill()

    def _broker(self, req: Json) -> McpBroker:
        label = mcp_label(req)
        broker = self.brokers.get(label)
        if broker is None:
            raise OpError("not_found", "no MCP broker %s in this sandbox" % label, param="label")
        return broker

    def _new_broker(self, label: str, transport: Any) -> McpBroker:
        if not isinstance(transport, dict):
            raise OpError("invalid_argument", "transport must be an object", param="transport")
        kind = transport.get("type")
        if kind == "stdio":
            return self._new_stdio_broker(label, transport)
        if kind == "http":
            url = req_str(transport, "server_url")
            if not (url.startswith("http://") or url.startswith("https://")):
                raise OpError("invalid_argument", "server_url must be an http or https URL", param="server_url")
            headers = str_dict(transport.get("headers"), "headers")
            if any("\r" in v or "\n" in v or "\r" in k or "\n" in k for k, v in headers.items()):
                raise OpError("invalid_argument", "headers must not contain line breaks", param="headers")
            return HttpEndpoint(label, url, headers, proxy_for(url, self.workspace.sandbox_env()))
        raise OpError("invalid_argument", "transport.type must be stdio or http", param="transport")

    def _new_stdio_broker(self, label: str, transport: Json) -> StdioBroker:
        command = req_str(transport, "command")
        args = str_list(transport.get("args"), "args")
        inherit = str_list(transport.get("env_vars"), "env_vars")
        explicit = opt_env(transport)
        cwd = self.workspace.cwd(transport)
        marker = "mcp_" + os.urandom(8).hex()
        # Only the named variables of the sandbox's environment reach the
        # server, on top of the basics every command gets.
        sandbox_env = self.workspace.sandbox_env()
        variables = {name: sandbox_env[name] for name in inherit if name in sandbox_env}
        variables.update(explicit)
        env = self.workspace.command_env(variables)
        try:
            child = self.reaper.spawn([command] + args, cwd, env, marker, True)
        except (FileNotFoundError, PermissionError, NotADirectoryError) as exc:
            raise OpError("invalid_argument", "cannot start MCP server %s: %s" % (label, exc), param="command") from None
        return StdioBroker(label, child)

    async def _op_mcp_start(self, conn: Sender, rid: int, req: Json) -> Json:
        label = mcp_label(req)
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

    async def _op_mcp_request(self, conn: Sender, rid: int, req: Json) -> Json:
        broker = self._broker(req)
        message = mcp_message(req)
        if not is_request(message):
            raise OpError("invalid_argument", "mcp.request takes a request (method and id); send others with mcp.notify", param="message")
        return {"message": await broker.request(message)}

    async def _op_mcp_notify(self, conn: Sender, rid: int, req: Json) -> Json:
        broker = self._broker(req)
        message = mcp_message(req)
        if not (is_notification(message) or is_response(message)):
            raise OpError("invalid_argument", "mcp.notify takes a notification or a response; send requests with mcp.request", param="message")
        return {"forwarded": await broker.notify(message)}

    async def _op_mcp_subscribe(self, conn: Sender, rid: int, req: Json) -> Json:
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

    async def _op_mcp_list(self, conn: Sender, rid: int, req: Json) -> Json:
        return {"brokers": [broker.describe() for broker in self.brokers.values()]}

    async def _op_mcp_stop(self, conn: Sender, rid: int, req: Json) -> Json:
        broker = self._broker(req)
        await broker.stop()
        return broker.describe()

    async def _op_mcp_close_upstream(self, conn: Sender, rid: int, req: Json) -> Json:
        broker = self._broker(req)
        closed = False if broker.dead else await broker.close_upstream()
        return {"closed": closed}

    async def _op_mcp_upstream(self, conn: Sender, rid: int, req: Json) -> Json:
        broker = self._broker(req)
        if isinstance(broker, HttpEndpoint):
            return broker.upstream()
        return {"transport": broker.transport, "state": broker.state}

    async def _op_mcp_remember_handshake(self, conn: Sender, rid: int, req: Json) -> Json:
        broker = self._broker(req)
        if not isinstance(broker, HttpEndpoint):
            raise OpError("invalid_argument", "only HTTP labels keep a handshake here", param="label")
        params = req.get("params")
        if not isinstance(params, dict):
            raise OpError("invalid_argument", "params must be an object", param="params")
        broker.init_params = params
        return {}
