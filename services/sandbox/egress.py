"""The egress proxy of ``restricted`` sandboxes.

A restricted sandbox has no network of its own (bubblewrap ``--unshare-net``,
Docker ``network_mode=none``): only its loopback interface. The Sandbox
service serves one filtering HTTP proxy per restricted sandbox on the unix
socket ``egress.sock`` in the directory the backend mounts at ``/run/berth``;
inside the sandbox, sandboxd relays ``127.0.0.1:<EGRESS_PROXY_PORT>`` to that
socket and commands get ``HTTP(S)_PROXY`` pointing at the relay. So the only
way out is HTTP through this proxy:

* ``CONNECT host:port`` opens a TCP tunnel (TLS stays end to end; the proxy
  never sees inside it, so it checks the CONNECT target only, not SNI);
* a plain HTTP request with an absolute URI (``GET http://host/path``) is
  forwarded with ``Connection: close``, one request per client connection.

Every target is checked against the sandbox's ``EgressPolicy`` (see there
for the matching rules); a refused one is answered ``403``. Unless
``allow_private`` is set, a target that is, or resolves to, a loopback,
private, link-local (cloud metadata), shared, multicast or otherwise
non-global address is refused too, and the connection goes to the vetted
address rather than resolving the name again. With an upstream proxy
configured for sandboxes (``BERTH_SANDBOX_HTTPS_PROXY`` /
``BERTH_SANDBOX_HTTP_PROXY``), allowed targets are reached through it:
tunnels with ``CONNECT`` to the upstream, plain requests forwarded to it
as they are; names are then resolved by the upstream, so the address check
covers IP literals only. Hosts in ``BERTH_SANDBOX_NO_PROXY`` bypass the
upstream.

A sandbox with ``environment_variable`` vault credentials has its CONNECTs
to their hosts on ports 443 and 8443 intercepted instead of tunnelled, to
put the secrets in place of their placeholders (``egress_substitution.py``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import os
import secrets
import socket
import ssl
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from services.core.addresses import IPAddress, is_public_address, parse_host
from services.core.logging import get_logger
from services.core.metrics import SANDBOX_EGRESS
from services.core.settings import Settings
from services.sandbox.egress_substitution import SUBSTITUTION_PORTS, InterceptFailed, Interceptor, Substitution

__all__ = [
    "EgressPolicy",
    "EgressOptions",
    "EgressProxy",
    "EgressProxies",
    "IPAddress",
    "parse_host",
    "is_public_address",
]

log = get_logger(__name__)

_MAX_HEAD_BYTES = 64 * 1024
_HEAD_TIMEOUT_S = 30.0
_COPY_BYTES = 64 * 1024
_MAX_CONNECTIONS = 256
_CLOSE_GRACE_S = 1.0
# Request headers that concern the hop to this proxy, never the next one.
_HOP_HEADERS = frozenset({"proxy-connection", "proxy-authorization", "keep-alive", "connection"})


# ---------------------------------------------------------------- hosts and policy


@dataclass(frozen=True)
class _Rule:
    """One policy entry: every host, an exact address, or a domain with
    (``subdomains_only`` False) or without itself."""

    any_host: bool = False
    address: IPAddress | None = None
    domain: str = ""
    subdomains_only: bool = False

    def matches(self, host: str | IPAddress) -> bool:
        if self.any_host:
            return True
        if self.address is not None:
            return host == self.address
        if not isinstance(host, str) or not self.domain:
            return False
        return host.endswith("." + self.domain) or (host == self.domain and not self.subdomains_only)


def _rule(entry: str) -> _Rule | None:
    text = entry.strip().lower()
    if text == "*":
        return _Rule(any_host=True)
    subdomains_only = text.startswith("*.")
    text = text[2:] if subdomains_only else text.removeprefix(".")
    if "*" in text:
        return None
    host = parse_host(text)
    if host is None or (subdomains_only and not isinstance(host, str)):
        return None
    if isinstance(host, str):
        return _Rule(domain=host, subdomains_only=subdomains_only)
    return _Rule(address=host)


class EgressPolicy:
    """Which hosts a restricted sandbox may reach.

    ``blocked_domains`` always wins. With a non-empty ``allowed_domains``
    only the hosts it matches pass; with an empty one every host not blocked
    does. An entry ``example.com`` (or ``.example.com``) matches that domain
    and every subdomain (``api.example.com``, not ``badexample.com``);
    ``*.example.com`` matches the subdomains only; ``*`` matches every host.
    Matching ignores case and a trailing dot, and internationalized names
    compare in their IDNA form. An IP address entry matches that address
    only, and no domain entry matches an IP literal. An entry that is none of
    these (a port, another wildcard) matches nothing."""

    def __init__(self, allowed_domains: Iterable[str] = (), blocked_domains: Iterable[str] = ()) -> None:
        self.allowed_domains = tuple(str(d) for d in allowed_domains)
        self.blocked_domains = tuple(str(d) for d in blocked_domains)
        self._allowed = self._rules(self.allowed_domains)
        self._blocked = self._rules(self.blocked_domains)

    @staticmethod
    def _rules(entries: tuple[str, ...]) -> list[_Rule]:
        rules: list[_Rule] = []
        for entry in entries:
            rule = _rule(entry)
            if rule is None:
                log.warning("egress_policy_entry_ignored", entry=entry)
            else:
                rules.append(rule)
        return rules

    def permits(self, host: str | IPAddress) -> bool:
        """``host`` as returned by ``parse_host``."""
        if any(rule.matches(host) for rule in self._blocked):
            return False
        # Decided by the entries as given: a list of only unusable entries
        # still restricts (to nothing).
        if not self.allowed_domains:
            return True
        return any(rule.matches(host) for rule in self._allowed)


# ---------------------------------------------------------------- options


@dataclass(frozen=True)
class _Upstream:
    """A proxy URL; ``unusable`` says why one that is set cannot be used
    (then nothing is connected rather than bypassing it)."""

    host: str
    port: int
    tls: bool
    authorization: str
    unusable: str = ""

    @classmethod
    def parse(cls, url: str) -> _Upstream | None:
        url = url.strip()
        if not url:
            return None
        if "://" not in url:
            url = "http://" + url
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError:
            return cls(host="", port=0, tls=False, authorization="", unusable="not a URL")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return cls(host="", port=0, tls=False, authorization="", unusable=f"scheme {parts.scheme!r} is not http(s)")
        authorization = ""
        if parts.username is not None:
            credentials = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            authorization = "Basic " + base64.b64encode(credentials.encode()).decode()
        port = port or (443 if parts.scheme == "https" else 80)
        return cls(host=parts.hostname, port=port, tls=parts.scheme == "https", authorization=authorization)


def _no_proxy_matches(entries: tuple[str, ...], host: str | IPAddress) -> bool:
    for entry in entries:
        if entry == "*":
            return True
        if isinstance(host, str):
            domain = entry.removeprefix("*.").removeprefix(".")
            if host == domain or host.endswith("." + domain):
                return True
        else:
            with contextlib.suppress(ValueError):
                if host in ipaddress.ip_network(entry, strict=False):
                    return True
    return False


@dataclass(frozen=True)
class EgressOptions:
    """How every egress proxy of the service connects out."""

    allow_private: bool = False
    http_upstream: str = ""
    https_upstream: str = ""
    no_proxy: str = ""
    connect_timeout_s: float = 10.0

    @classmethod
    def from_settings(cls, settings: Settings) -> EgressOptions:
        return cls(
            allow_private=settings.sandbox_egress_allow_private,
            http_upstream=settings.sandbox_http_proxy,
            https_upstream=settings.sandbox_https_proxy,
            no_proxy=settings.sandbox_no_proxy,
        )


class _Refused(Exception):
    """A request the proxy answers with an error status."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"{status} {reason}")
        self.status = status
        self.reason = reason


_REASONS = {
    400: "Bad Request",
    403: "Forbidden",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


# ---------------------------------------------------------------- one proxy


@dataclass(frozen=True)
class _Request:
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]
    host: str | IPAddress
    port: int
    # Path and query, the request target a server expects; empty for CONNECT.
    origin_form: str = ""

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if isinstance(self.host, ipaddress.IPv6Address) else str(self.host)
        return f"{host}:{self.port}"


def _parse_request(head: bytes) -> _Request:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise _Refused(400, "malformed request line")
    method, target, version = parts
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise _Refused(400, "malformed header")
        headers.append((name, value.strip()))
    if method == "CONNECT":
        raw_host, sep, raw_port = target.rpartition(":")
        if not sep or not raw_port.isdigit():
            raise _Refused(400, "CONNECT needs host:port")
        host, port = parse_host(raw_host), int(raw_port)
        if host is None or not 0 < port < 65536:
            raise _Refused(400, "invalid CONNECT target")
        return _Request(method, target, version, headers, host, port)
    try:
        url = urlsplit(target)
        url_port = url.port
    except ValueError:
        raise _Refused(400, "invalid request target") from None
    if url.scheme != "http" or not url.hostname:
        # https:// goes through CONNECT; anything else is not proxied.
        raise _Refused(400, "the proxy takes absolute http:// URIs and CONNECT")
    host = parse_host(url.hostname)
    if host is None:
        raise _Refused(400, "invalid host")
    path = url.path or "/"
    if url.query:
        path += "?" + url.query
    return _Request(method, target, version, headers, host, url_port or 80, origin_form=path)


def _forward_head(request: _Request, request_target: str, extra: list[tuple[str, str]]) -> bytes:
    connection = {
        token.strip().lower() for name, value in request.headers if name.lower() == "connection" for token in value.split(",")
    }
    # Host is the checked URI's authority, whatever the client sent: a
    # different Host would reach another site behind the same server.
    dropped = _HOP_HEADERS | connection | {"host"}
    headers = [("Host", request.authority.removesuffix(":80"))]
    headers += [(name, value) for name, value in request.headers if name.lower() not in dropped]
    # An upgrade (WebSocket) keeps its connection; anything else ends after one response.
    if "upgrade" in connection and any(name.lower() == "upgrade" for name, _ in headers):
        headers.append(("Connection", "Upgrade"))
    else:
        headers.append(("Connection", "close"))
    lines = [f"{request.method} {request_target} {request.version}", *(f"{n}: {v}" for n, v in headers + extra)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copies until EOF, then half-closes; an error closes ``writer`` so the
    opposite direction ends too."""
    try:
        while data := await reader.read(_COPY_BYTES):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()


async def _close(writer: asyncio.StreamWriter) -> None:
    """Closes, flushing for a moment; a peer that reads nothing (a frozen
    sandbox) gets the connection aborted instead."""
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), _CLOSE_GRACE_S)
    except (ConnectionError, OSError, TimeoutError):
        writer.transport.abort()


def _bind_unix(path: str) -> tuple[socket.socket, int]:
    """Binds ``path`` through ``/proc/self/fd`` aliases of directories (the
    host path may exceed sun_path). The socket is made in the parent of its
    directory, which only the host can write, and made connectable by the
    sandbox's unprivileged user there, then renamed into place: whatever a
    sandbox left at the name is replaced, never followed, and no chmod ever
    touches a path the sandbox controls. Returns the socket and its inode."""
    directory, name = os.path.split(path)
    dir_fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    private_fd = os.open(os.path.dirname(directory), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    staged = f".{name}.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(f"/proc/self/fd/{private_fd}/{staged}")
            # Only the sandbox's own directory leads to it; connecting needs write permission.
            os.chmod(f"/proc/self/fd/{private_fd}/{staged}", 0o666)
            os.rename(staged, name, src_dir_fd=private_fd, dst_dir_fd=dir_fd)
            sock.listen(128)
            sock.setblocking(False)
            inode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_ino
        except BaseException:
            sock.close()
            with contextlib.suppress(OSError):
                os.unlink(staged, dir_fd=private_fd)
            raise
    finally:
        os.close(dir_fd)
        os.close(private_fd)
    return sock, inode


class EgressProxy:
    """The filtering proxy of one sandbox, on one unix socket."""

    def __init__(
        self,
        sandbox_id: str,
        socket_path: str,
        policy: EgressPolicy,
        options: EgressOptions,
        *,
        substitutions: Sequence[Substitution] = (),
        interceptor: Interceptor | None = None,
    ) -> None:
        if substitutions and interceptor is None:
            raise ValueError("secret substitution needs the egress CA")
        self.sandbox_id = sandbox_id
        self.socket_path = socket_path
        self.policy = policy
        self._options = options
        self._substitutions = tuple(substitutions)
        self._interceptor = interceptor
        self._http_upstream = _Upstream.parse(options.http_upstream or options.https_upstream)
        self._connect_upstream = _Upstream.parse(options.https_upstream or options.http_upstream)
        self._no_proxy = tuple(e.strip().lower() for e in options.no_proxy.split(",") if e.strip())
        self._server: asyncio.Server | None = None
        self._inode = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        sock, self._inode = await asyncio.to_thread(_bind_unix, self.socket_path)
        try:
            self._server = await asyncio.start_unix_server(self._on_client, sock=sock, limit=_MAX_HEAD_BYTES)
        except BaseException:
            sock.close()
            raise

    async def close(self) -> None:
        """Stops listening and cuts every open connection and tunnel."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        # Only our own socket: a newer proxy may already listen at the name.
        with contextlib.suppress(OSError):
            if os.stat(self.socket_path, follow_symlinks=False).st_ino == self._inode:
                os.unlink(self.socket_path)

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            if len(self._tasks) > _MAX_CONNECTIONS:
                await self._respond(writer, 503)
                return
            await self._serve(reader, writer)
        except (ConnectionError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            pass
        finally:
            self._tasks.discard(task)
            await _close(writer)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _HEAD_TIMEOUT_S)
            request = _parse_request(head)
        except (_Refused, asyncio.LimitOverrunError) as exc:
            self._decide(None, None, "", "denied", "invalid_request")
            await self._respond(writer, exc.status if isinstance(exc, _Refused) else 400)
            return
        if not self.policy.permits(request.host):
            self._decide(request.host, request.port, request.method, "denied", "policy")
            await self._respond(writer, 403)
            return
        try:
            upstream_reader, upstream_writer = await self._open(request)
        except _Refused as refused:
            if refused.status == 403:
                self._decide(request.host, request.port, request.method, "denied", refused.reason)
            else:
                log.info(
                    "egress_connect_failed",
                    sandbox_id=self.sandbox_id,
                    host=str(request.host),
                    port=request.port,
                    status=refused.status,
                    error=refused.reason,
                )
            await self._respond(writer, refused.status)
            return
        self._decide(request.host, request.port, request.method, "allowed", "policy")
        substitutions = self._substitutions_for(request)
        if substitutions and self._interceptor is not None:
            try:
                await self._intercept(request, (reader, writer), (upstream_reader, upstream_writer), substitutions)
            finally:
                await _close(upstream_writer)
            return
        try:
            if request.method == "CONNECT":
                writer.write(b"HTTP/1.1 200 Connection Established\r\nProxy-Agent: berth-egress\r\n\r\n")
                await writer.drain()
            await asyncio.gather(_copy(reader, upstream_writer), _copy(upstream_reader, writer))
        finally:
            await _close(upstream_writer)

    def _substitutions_for(self, request: _Request) -> list[Substitution]:
        if request.method != "CONNECT" or request.port not in SUBSTITUTION_PORTS:
            return []
        return [s for s in self._substitutions if s.applies_to(request.host)]

    def replace_substitutions(self, substitutions: Sequence[Substitution]) -> None:
        """New connections, and the next request on an intercepted one, use
        ``substitutions``; a tunnel opened before stays a tunnel."""
        self._substitutions = tuple(substitutions)

    async def _intercept(
        self,
        request: _Request,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        substitutions: list[Substitution],
    ) -> None:
        assert self._interceptor is not None
        log.info(
            "egress_substitution_started",
            sandbox_id=self.sandbox_id,
            host=str(request.host),
            port=request.port,
            credential_ids=[s.credential_id for s in substitutions],
        )
        try:
            await self._interceptor.run(
                str(request.host), request.port, client, upstream, lambda: self._substitutions_for(request)
            )
        except InterceptFailed as exc:
            log.info("egress_connect_failed", sandbox_id=self.sandbox_id, host=str(request.host), port=request.port, status=502, error=str(exc))
            await self._respond(client[1], 502)

    def _decide(self, host: str | IPAddress | None, port: int | None, method: str, decision: str, reason: str) -> None:
        SANDBOX_EGRESS.labels(decision=decision, reason=reason).inc()
        event = "egress_allowed" if decision == "allowed" else "egress_denied"
        log.info(event, sandbox_id=self.sandbox_id, host=None if host is None else str(host), port=port, method=method, reason=reason)

    @staticmethod
    async def _respond(writer: asyncio.StreamWriter, status: int) -> None:
        reason = _REASONS.get(status, "Error")
        body = f"{status} {reason} (berth egress proxy)\n".encode()
        writer.write(
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\nProxy-Agent: berth-egress\r\n\r\n".encode()
            + body
        )
        with contextlib.suppress(ConnectionError, OSError):
            await writer.drain()

    # ------------------------------------------------------------ connecting out

    async def _open(self, request: _Request) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Connects to the request's next hop and sends what it must see
        first (the rewritten head of a plain request)."""
        tunnel = request.method == "CONNECT"
        upstream = self._connect_upstream if tunnel else self._http_upstream
        if upstream is not None and _no_proxy_matches(self._no_proxy, request.host):
            upstream = None
        if upstream is not None:
            if not isinstance(request.host, str):
                self._check_address(request.host)
            return await self._via_upstream(upstream, request)
        reader, writer = await self._connect_direct(request.host, request.port)
        if not tunnel:
            writer.write(_forward_head(request, request.origin_form, []))
        return reader, writer

    def _check_address(self, address: IPAddress) -> None:
        if not self._options.allow_private and not is_public_address(address):
            raise _Refused(403, "private_address")

    async def _connect_direct(self, host: str | IPAddress, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        loop = asyncio.get_running_loop()
        timeout = self._options.connect_timeout_s
        if isinstance(host, str):
            try:
                infos = await asyncio.wait_for(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), timeout)
            except (OSError, TimeoutError):
                raise _Refused(502, "name_not_resolved") from None
            addresses = [ipaddress.ip_address(str(info[4][0]).partition("%")[0]) for info in infos]
        else:
            addresses = [host]
        # One non-public answer refuses the name: it may be rebound between tries.
        for address in addresses:
            self._check_address(address)
        last: Exception | None = None
        for address in dict.fromkeys(addresses):
            try:
                return await asyncio.wait_for(
                    asyncio.open_connection(str(address), port, flags=socket.AI_NUMERICHOST, limit=_COPY_BYTES), timeout
                )
            except (OSError, TimeoutError) as exc:
                last = exc
        raise _Refused(504 if isinstance(last, TimeoutError) else 502, f"connect_failed: {last!r}")

    async def _via_upstream(self, upstream: _Upstream, request: _Request) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if upstream.unusable:
            raise _Refused(502, f"upstream_proxy_unusable: {upstream.unusable}")
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(
                    upstream.host, upstream.port, ssl=ssl.create_default_context() if upstream.tls else None, limit=_MAX_HEAD_BYTES
                ),
                self._options.connect_timeout_s,
            )
        except (OSError, TimeoutError) as exc:
            raise _Refused(502, f"upstream_proxy_unreachable: {exc!r}") from None
        auth = [("Proxy-Authorization", upstream.authorization)] if upstream.authorization else []
        if request.method != "CONNECT":
            writer.write(_forward_head(request, request.target, auth))
            return reader, writer
        lines = [f"CONNECT {request.authority} HTTP/1.1", f"Host: {request.authority}", *(f"{n}: {v}" for n, v in auth)]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _HEAD_TIMEOUT_S)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            await _close(writer)
            raise _Refused(502, "upstream_proxy_failed") from None
        status = head.split(b" ", 2)[1] if head.count(b" ") >= 1 else b""
        if status != b"200":
            await _close(writer)
            raise _Refused(502, f"upstream_proxy_refused: {status.decode(errors='replace')}")
        return reader, writer


# ---------------------------------------------------------------- every proxy of the service


class EgressProxies:
    """The egress proxies of this service's restricted sandboxes, by sandbox ID."""

    def __init__(self, options: EgressOptions, *, interceptor: Interceptor | None = None) -> None:
        """``interceptor`` (the egress CA) is what secret substitution needs;
        without it a sandbox with substitutions gets no proxy at all."""
        self._options = options
        self._interceptor = interceptor
        self._proxies: dict[str, EgressProxy] = {}
        for setting, url in (("sandbox_http_proxy", options.http_upstream), ("sandbox_https_proxy", options.https_upstream)):
            upstream = _Upstream.parse(url)
            if upstream is not None and upstream.unusable:
                # Fails closed: restricted sandboxes get 502 rather than a way around it.
                log.warning("egress_upstream_proxy_unusable", setting=setting, reason=upstream.unusable)

    async def start(
        self, sandbox_id: str, socket_path: str, policy: EgressPolicy, substitutions: Sequence[Substitution] = ()
    ) -> None:
        """Serves ``policy`` for ``sandbox_id`` on ``socket_path``, replacing
        the sandbox's earlier proxy."""
        await self.stop(sandbox_id)
        proxy = EgressProxy(
            sandbox_id, socket_path, policy, self._options, substitutions=substitutions, interceptor=self._interceptor
        )
        await proxy.start()
        self._proxies[sandbox_id] = proxy
        log.info(
            "egress_proxy_started",
            sandbox_id=sandbox_id,
            allowed_domains=list(policy.allowed_domains),
            blocked_domains=list(policy.blocked_domains),
            credential_ids=[s.credential_id for s in substitutions],
        )

    def replace_substitutions(self, sandbox_id: str, substitutions: Sequence[Substitution]) -> bool:
        """Whether ``sandbox_id`` has a proxy here, which now substitutes
        ``substitutions`` (see ``EgressProxy.replace_substitutions``)."""
        proxy = self._proxies.get(sandbox_id)
        if proxy is None:
            return False
        if substitutions and self._interceptor is None:
            raise ValueError("secret substitution needs the egress CA")
        proxy.replace_substitutions(substitutions)
        log.info("egress_substitutions_replaced", sandbox_id=sandbox_id, credential_ids=[s.credential_id for s in substitutions])
        return True

    async def stop(self, sandbox_id: str) -> None:
        proxy = self._proxies.pop(sandbox_id, None)
        if proxy is not None:
            await proxy.close()

    def running(self, sandbox_id: str) -> bool:
        return sandbox_id in self._proxies

    async def close(self) -> None:
        for sandbox_id in list(self._proxies):
            await self.stop(sandbox_id)
