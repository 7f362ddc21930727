"""The egress proxy on its own: the domain matcher, the address checks, and
a proxy served on a unix socket in tmp_path, driven from the host."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from egress_helpers import Target, echo_target, http_target, local_names_only  # noqa: F401 (fixture)
from prometheus_client import REGISTRY

from services.sandbox.egress import EgressOptions, EgressPolicy, EgressProxies, EgressProxy, is_public_address, parse_host

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def _require_bwrap() -> None:
    """Replaces the directory-wide bubblewrap check: no sandbox here."""


@pytest.fixture(autouse=True)
def _no_remote_lookups(local_names_only: list[str]) -> Iterator[None]:
    yield
    assert local_names_only == [], "the proxy tried to resolve a name it must not"


def permits(policy: EgressPolicy, host: str) -> bool:
    parsed = parse_host(host)
    assert parsed is not None, host
    return policy.permits(parsed)


# ---------------------------------------------------------------- matching


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("example.com", True),
        ("api.example.com", True),
        ("a.b.example.com", True),
        ("badexample.com", False),
        ("example.com.evil.net", False),
        ("example.org", False),
    ],
)
def test_a_domain_entry_matches_itself_and_its_subdomains_only(host: str, allowed: bool) -> None:
    assert permits(EgressPolicy(["example.com"]), host) is allowed


def test_blocked_domains_win_over_allowed_domains() -> None:
    policy = EgressPolicy(["example.com"], ["internal.example.com"])

    assert permits(policy, "api.example.com")
    assert not permits(policy, "internal.example.com")
    assert not permits(policy, "db.internal.example.com")


def test_an_empty_allowlist_lets_every_host_pass_that_is_not_blocked() -> None:
    policy = EgressPolicy([], ["tracker.net"])

    assert permits(policy, "example.com")
    assert permits(policy, "93.184.216.34")
    assert not permits(policy, "ads.tracker.net")


@pytest.mark.parametrize("host", ["EXAMPLE.com", "Api.Example.COM.", "api.example.com."])
def test_matching_ignores_case_and_a_trailing_dot(host: str) -> None:
    assert permits(EgressPolicy(["Example.Com."]), host)
    assert not permits(EgressPolicy([], ["example.com"]), host)


def test_an_ip_literal_passes_only_when_listed_exactly() -> None:
    policy = EgressPolicy(["10.0.0.1", "[2001:db8::1]", "example.com", "0.1"])

    assert permits(policy, "10.0.0.1")
    assert permits(policy, "[2001:db8::1]")
    assert not permits(policy, "10.0.0.2")
    # Another spelling of the same address is that address.
    assert permits(policy, "10.0.1")
    # No domain entry (not even a numeric-looking one) matches an address.
    assert not permits(policy, "192.168.0.1")
    assert not permits(EgressPolicy(["example.com"]), "127.0.0.1")


def test_a_wildcard_entry_matches_subdomains_but_not_the_domain_itself() -> None:
    policy = EgressPolicy(["*.example.com"])

    assert permits(policy, "api.example.com")
    assert not permits(policy, "example.com")
    assert permits(EgressPolicy(["*"]), "anything.example")


def test_unusable_entries_match_nothing_and_still_restrict() -> None:
    policy = EgressPolicy(["example.com:443", "api-*.example.com", "https://x"])

    assert not permits(policy, "example.com")
    assert not permits(policy, "api-1.example.com")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("127.1", ipaddress.ip_address("127.0.0.1")),
        ("0x7f000001", ipaddress.ip_address("127.0.0.1")),
        ("2130706433", ipaddress.ip_address("127.0.0.1")),
        ("[::1]", ipaddress.ip_address("::1")),
        ("bücher.de", "xn--bcher-kva.de"),
        ("with space.com", None),
        ("a..b", None),
        ("x" * 64 + ".com", None),
    ],
)
def test_hosts_are_parsed_the_way_the_resolver_would_read_them(raw: str, expected: object) -> None:
    assert parse_host(raw) == expected


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "169.254.169.254",
        "100.100.100.200",
        "0.0.0.0",
        "224.0.0.1",
        "::1",
        "fe80::1",
        "fd00:ec2::254",
        "::ffff:10.0.0.1",
        "64:ff9b::a9fe:a9fe",
        "2002:7f00:1::",
    ],
)
def test_loopback_private_link_local_and_metadata_addresses_are_not_public(address: str) -> None:
    assert not is_public_address(ipaddress.ip_address(address))


@pytest.mark.parametrize("address", ["93.184.216.34", "8.8.8.8", "2606:4700::1111", "::ffff:8.8.8.8"])
def test_globally_routable_addresses_are_public(address: str) -> None:
    assert is_public_address(ipaddress.ip_address(address))


# ---------------------------------------------------------------- the proxy


def egress_count(decision: str, reason: str) -> float:
    return REGISTRY.get_sample_value("berth_sandbox_egress_requests_total", {"decision": decision, "reason": reason}) or 0.0


@contextlib.asynccontextmanager
async def running_proxy(tmp_path: Path, policy: EgressPolicy, options: EgressOptions) -> AsyncIterator[EgressProxy]:
    # A long directory, as a sandbox's is, exercises the sun_path workaround.
    directory = tmp_path / ("d" * 80) / "run"
    directory.mkdir(parents=True)
    proxy = EgressProxy("sbx_test", str(directory / "egress.sock"), policy, options)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()


async def open_proxy(socket_path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    directory, name = os.path.split(socket_path)
    fd = os.open(directory, os.O_PATH)
    try:
        return await asyncio.open_unix_connection(f"/proc/self/fd/{fd}/{name}")
    finally:
        os.close(fd)


async def exchange(proxy: EgressProxy | str, request: bytes) -> tuple[int, bytes, asyncio.StreamReader, asyncio.StreamWriter]:
    """Sends ``request`` to a proxy (or the socket path of one); returns the
    status, the response head and the open streams."""
    reader, writer = await open_proxy(proxy if isinstance(proxy, str) else proxy.socket_path)
    writer.write(request)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    return int(head.split(b" ")[1]), head, reader, writer


async def test_a_plain_request_for_an_allowed_host_is_forwarded_in_origin_form_to_that_host(tmp_path: Path) -> None:
    async with http_target() as target, running_proxy(tmp_path, EgressPolicy(["localhost"]), EgressOptions(allow_private=True)) as proxy:
        status, _, reader, writer = await exchange(
            proxy,
            b"GET http://localhost:%d/hello?x=1 HTTP/1.1\r\nHost: blocked.example\r\nProxy-Connection: keep-alive\r\n\r\n"
            % target.port,
        )
        body = await asyncio.wait_for(reader.read(), 10)
        writer.close()

    assert status == 200
    assert body == b"hello from the host: GET /hello?x=1 HTTP/1.1"
    forwarded = target.requests[0].lower()
    assert b"proxy-connection" not in forwarded
    assert b"connection: close" in forwarded
    # The Host header names the checked host, not what the client claimed.
    assert b"\r\nhost: localhost:%d\r\n" % target.port in forwarded
    assert b"blocked.example" not in forwarded


async def test_a_denied_host_gets_403_and_nothing_is_connected(tmp_path: Path) -> None:
    before = egress_count("denied", "policy")
    async with http_target() as target, running_proxy(
        tmp_path, EgressPolicy(["localhost"], ["blocked.localhost"]), EgressOptions(allow_private=True)
    ) as proxy:
        for request in (
            b"GET http://127.0.0.1:%d/ HTTP/1.1\r\n\r\n" % target.port,
            b"GET http://blocked.localhost:%d/ HTTP/1.1\r\n\r\n" % target.port,
            b"CONNECT example.com:443 HTTP/1.1\r\n\r\n",
        ):
            status, _, _, writer = await exchange(proxy, request)
            writer.close()
            assert status == 403, request

    assert target.connections == 0
    assert egress_count("denied", "policy") == before + 3


async def test_private_targets_are_refused_unless_allowed_by_setting(tmp_path: Path) -> None:
    policy = EgressPolicy(["localhost", "127.0.0.1"])
    async with http_target() as target:
        async with running_proxy(tmp_path / "strict", policy, EgressOptions()) as proxy:
            for host in (b"localhost", b"127.0.0.1"):
                status, _, _, writer = await exchange(proxy, b"GET http://%s:%d/ HTTP/1.1\r\n\r\n" % (host, target.port))
                writer.close()
                assert status == 403, host
        assert target.connections == 0

        async with running_proxy(tmp_path / "lenient", policy, EgressOptions(allow_private=True)) as proxy:
            status, _, _, writer = await exchange(proxy, b"GET http://localhost:%d/ HTTP/1.1\r\n\r\n" % target.port)
            writer.close()
        assert status == 200


async def test_a_connect_tunnel_to_an_allowed_host_carries_bytes_both_ways(tmp_path: Path) -> None:
    async with echo_target() as target, running_proxy(tmp_path, EgressPolicy(["localhost"]), EgressOptions(allow_private=True)) as proxy:
        status, _, reader, writer = await exchange(proxy, b"CONNECT localhost:%d HTTP/1.1\r\nHost: localhost\r\n\r\n" % target.port)
        writer.write(b"through the tunnel\n")
        await writer.drain()
        echoed = await asyncio.wait_for(reader.readline(), 10)
        writer.close()

    assert status == 200
    assert echoed == b"through the tunnel\n"


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /relative HTTP/1.1\r\nHost: localhost\r\n\r\n",
        b"GET https://localhost/ HTTP/1.1\r\n\r\n",
        b"CONNECT localhost HTTP/1.1\r\n\r\n",
        b"CONNECT bad host:443 HTTP/1.1\r\n\r\n",
        b"NONSENSE\r\n\r\n",
    ],
)
async def test_requests_the_proxy_cannot_route_get_400(tmp_path: Path, request_bytes: bytes) -> None:
    async with running_proxy(tmp_path, EgressPolicy(), EgressOptions(allow_private=True)) as proxy:
        status, _, _, writer = await exchange(proxy, request_bytes)
        writer.close()

    assert status == 400


@contextlib.asynccontextmanager
async def fake_upstream_proxy() -> AsyncIterator[Target]:
    """An upstream proxy that records each request head, accepts CONNECT and
    then echoes, and answers a forwarded plain request itself."""
    async with echo_target() as upstream:

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            upstream.requests.append(head)
            if head.startswith(b"CONNECT "):
                writer.write(b"HTTP/1.1 200 OK\r\n\r\n")
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\nConnection: close\r\n\r\nupstream")
                await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0, family=socket.AF_INET)
        upstream.port = server.sockets[0].getsockname()[1]
        try:
            yield upstream
        finally:
            server.close()
            await server.wait_closed()


async def test_allowed_targets_are_reached_through_the_configured_upstream_proxy(tmp_path: Path) -> None:
    async with fake_upstream_proxy() as upstream:
        options = EgressOptions(https_upstream=f"http://user:secret@127.0.0.1:{upstream.port}")
        async with running_proxy(tmp_path, EgressPolicy(["example.com"]), options) as proxy:
            # The upstream resolves example.com; this process never does.
            status, _, reader, writer = await exchange(proxy, b"CONNECT api.example.com:443 HTTP/1.1\r\n\r\n")
            writer.write(b"tls bytes\n")
            await writer.drain()
            echoed = await asyncio.wait_for(reader.readline(), 10)
            writer.close()
            plain, _, reader, writer = await exchange(proxy, b"GET http://example.com/page HTTP/1.1\r\nHost: example.com\r\n\r\n")
            body = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            denied, _, _, writer = await exchange(proxy, b"CONNECT example.org:443 HTTP/1.1\r\n\r\n")
            writer.close()

    assert (status, echoed) == (200, b"tls bytes\n")
    assert (plain, body) == (200, b"upstream")
    assert denied == 403
    connect, forwarded = upstream.requests
    assert connect.startswith(b"CONNECT api.example.com:443 HTTP/1.1\r\n")
    assert b"Proxy-Authorization: Basic dXNlcjpzZWNyZXQ=" in connect
    assert forwarded.startswith(b"GET http://example.com/page HTTP/1.1\r\n")


async def test_hosts_in_no_proxy_bypass_the_upstream_proxy(tmp_path: Path) -> None:
    async with fake_upstream_proxy() as upstream, echo_target() as target:
        options = EgressOptions(https_upstream=f"http://127.0.0.1:{upstream.port}", no_proxy="localhost", allow_private=True)
        async with running_proxy(tmp_path, EgressPolicy(["localhost"]), options) as proxy:
            status, _, _, writer = await exchange(proxy, b"CONNECT localhost:%d HTTP/1.1\r\n\r\n" % target.port)
            writer.close()

    assert status == 200
    assert upstream.requests == []
    assert target.connections == 1


async def test_stopping_a_sandboxs_proxy_cuts_its_tunnels_and_removes_its_socket(tmp_path: Path) -> None:
    proxies = EgressProxies(EgressOptions(allow_private=True))
    directory = tmp_path / "run"
    directory.mkdir()
    socket_path = directory / "egress.sock"
    # A leftover at the name (a sandbox can write there) is replaced, not followed.
    (directory / "elsewhere").write_text("kept")
    socket_path.symlink_to(directory / "elsewhere")
    async with echo_target() as target:
        await proxies.start("sbx_stop", str(socket_path), EgressPolicy(["localhost"]))
        status, _, reader, writer = await exchange(str(socket_path), b"CONNECT localhost:%d HTTP/1.1\r\n\r\n" % target.port)

        await proxies.stop("sbx_stop")
        rest = await asyncio.wait_for(reader.read(), 10)
        writer.close()

    assert status == 200
    assert rest == b""
    assert not socket_path.exists() and not socket_path.is_symlink()
    assert (directory / "elsewhere").read_text() == "kept"
    assert not proxies.running("sbx_stop")


async def test_an_unusable_upstream_proxy_setting_fails_closed_with_502(tmp_path: Path) -> None:
    async with echo_target() as target:
        options = EgressOptions(https_upstream="socks5://127.0.0.1:1080", allow_private=True)
        async with running_proxy(tmp_path, EgressPolicy(["localhost"]), options) as proxy:
            status, _, _, writer = await exchange(proxy, b"CONNECT localhost:%d HTTP/1.1\r\n\r\n" % target.port)
            writer.close()

    assert status == 502
    assert target.connections == 0
