"""Test hosts that are not the Berth host: network namespaces this test run
makes itself, each joined to the host by a veth pair on a /30 of
10.231.0.0/16, with servers started inside them.

A sandbox with network ``enabled`` reaches one only when its address is in
``BERTH_SANDBOX_ALLOW_CIDRS`` (it is a private range): ``TestHost.cidr`` is
the value to allow."""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["TestHost", "make_test_host", "http_server_on", "free_port", "free_port_on"]


@dataclass
class TestHost:
    name: str
    address: str
    host_side: str
    cidr: str
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def spawn(self, argv: Sequence[str]) -> subprocess.Popen[bytes]:
        """Starts ``argv`` inside the test host's network namespace."""
        process = subprocess.Popen(
            in_netns(self.name, argv), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.processes.append(process)
        return process

    def wait_listening(self, port: int, process: subprocess.Popen[bytes], timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection((self.address, port), timeout=1).close()
                return
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"nothing listens on {self.address}:{port} in test host {self.name}") from None
                time.sleep(0.02)


def in_netns(name: str, argv: Sequence[str]) -> list[str]:
    """``argv`` run in the named network namespace. nsenter only joins the
    namespace; ``ip netns exec`` also remounts /sys in a new mount namespace,
    which fails now and then (exit 255) while sandboxes mount and unmount."""
    return ["nsenter", f"--net=/run/netns/{name}", "--", *argv]


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")


@contextmanager
def make_test_host() -> Iterator[TestHost]:
    """A fresh test host, removed (with everything started in it) on exit."""
    if shutil.which("ip") is None:
        raise RuntimeError("iproute2 (ip) is needed for test hosts")
    token = secrets.token_hex(3)
    name = f"berth-th-{token}"
    octet, quad = int(token[:2], 16), int(token[2:4], 16) % 64
    base = f"10.231.{octet}.{quad * 4}"
    host_ip, peer_ip = f"10.231.{octet}.{quad * 4 + 1}", f"10.231.{octet}.{quad * 4 + 2}"
    outer, inner = f"bth{token}", f"btp{token}"
    host = TestHost(name=name, address=peer_ip, host_side=host_ip, cidr=f"{base}/30")
    _ip("netns", "add", name)
    try:
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", name)
        _ip("addr", "add", f"{host_ip}/30", "dev", outer)
        _ip("link", "set", outer, "up")
        _ip("-n", name, "addr", "add", f"{peer_ip}/30", "dev", inner)
        _ip("-n", name, "link", "set", inner, "up")
        _ip("-n", name, "link", "set", "lo", "up")
        yield host
    finally:
        for process in host.processes:
            process.kill()
            process.wait()
        subprocess.run(["ip", "link", "del", outer], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def free_port() -> int:
    """A TCP port on the Berth host's 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_port_on(host: TestHost) -> int:
    out = subprocess.run(
        in_netns(host.name, [sys.executable, "-c",
         "import socket; s = socket.socket(); s.bind(('0.0.0.0', 0)); print(s.getsockname()[1])"]),
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    return int(out.strip())


@contextmanager
def http_server_on(host: TestHost, body: str = "hello from the test host") -> Iterator[str]:
    """An HTTP server inside ``host`` answering every GET with ``body``; yields its URL."""
    port = free_port_on(host)
    script = (
        "import http.server, sys\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        data = sys.argv[2].encode()\n"
        "        self.send_response(200); self.send_header('Content-Length', str(len(data))); self.end_headers()\n"
        "        self.wfile.write(data)\n"
        "    def log_message(self, *a): pass\n"
        "http.server.HTTPServer(('0.0.0.0', int(sys.argv[1])), H).serve_forever()\n"
    )
    process = host.spawn([sys.executable, "-c", script, str(port), body])
    try:
        host.wait_listening(port, process)
        yield f"http://{host.address}:{port}/"
    finally:
        process.kill()
        process.wait()
        if process in host.processes:
            host.processes.remove(process)


