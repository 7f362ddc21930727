"""An environment-origin MCP server reached over streamable HTTP.

sandboxd only registers the label: the first start's URL and headers, and
whether it is dead. The client itself (the ``mcp`` SDK's streamable HTTP
client) runs in the Sandbox service, and every connection it makes is a
``net.connect`` tunnel opened by this daemon inside the sandbox (see
``relay``), so the server is reached from the sandbox's network namespace
under its network policy, never from the host's.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from ..protocol import Json, OpError
from .broker import McpBroker, McpSubscriber


class HttpEndpoint(McpBroker):
    """The registration of an HTTP label: its upstream, for the Sandbox
    service's client, and its state (a stopped label stays dead)."""

    transport = "http"

    def __init__(self, label: str, url: str, headers: Dict[str, str], proxy: Optional[str]) -> None:
        super().__init__(label)
        self.url = url
        self.headers = headers
        self.proxy = proxy
        # The first client's initialize params, so a restarted Sandbox
        # service can open a session again for callers already initialized.
        self.init_params: Any = None

    def upstream(self) -> Json:
        return {
            "transport": "http",
            "server_url": self.url,
            "headers": dict(self.headers),
            "proxy": self.proxy,
            "state": self.state,
            "init_params": self.init_params,
        }

    def _elsewhere(self) -> OpError:
        return OpError(
            "failed_precondition",
            "the Sandbox service runs the client of HTTP MCP server %s; its messages do not go through sandboxd" % self.label,
            param="label",
        )

    async def request(self, msg: Json) -> Json:
        raise self._elsewhere()

    async def notify(self, msg: Json) -> bool:
        raise self._elsewhere()

    def subscribe(self) -> McpSubscriber:
        raise self._elsewhere()

    async def stop(self) -> None:
        self.mark_dead(None, "stopped")

    def kill(self) -> None:
        self.mark_dead(None, "stopped")


def proxy_for(url: str, env: Dict[str, str]) -> Optional[str]:
    """The proxy in the sandbox's environment ``env`` that applies to
    ``url``, so the HTTP client reaches the network as the sandbox's own
    commands do (a ``restricted`` sandbox's egress proxy, say)."""
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    value: Any = env.get(scheme + "_proxy") or env.get(scheme.upper() + "_PROXY")
    if not value:
        return None
    host = (parts.hostname or "").lower()
    no_proxy = env.get("no_proxy") or env.get("NO_PROXY") or ""
    for entry in no_proxy.split(","):
        entry = entry.strip().lower().lstrip(".")
        if entry == "*" or (entry and (host == entry or host.endswith("." + entry))):
            return None
    return str(value)
