"""A real MCP server (the official ``mcp`` package) for the Environment and
end-to-end MCP tests: as a stdio process inside a bubblewrap sandbox, and
over streamable HTTP on the host's 127.0.0.1.

Inside the sandbox the host's /usr/bin/python3 runs the server with the
venv's site-packages bound read-only at /opt/berth-site (on PYTHONPATH) and
the server script's directory at /opt/berth-mcp, so the venv's Python must
have the same minor version as /usr/bin/python3.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import sysconfig
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from hosts_support import TestHost, free_port, free_port_on
from waiting import wait_until

HOST_PYTHON = "/usr/bin/python3"
SITE_PACKAGES = sysconfig.get_paths()["purelib"]
SERVERS_DIR = Path(__file__).parent / "sandbox" / "mcp_servers"
SERVER_SCRIPT = SERVERS_DIR / "test_server.py"
SITE_IN_SANDBOX = "/opt/berth-site"
SERVER_IN_SANDBOX = "/opt/berth-mcp/test_server.py"
# For Settings(sandbox_extra_ro_mounts=...).
SANDBOX_MOUNTS = {SITE_PACKAGES: SITE_IN_SANDBOX, str(SERVERS_DIR): os.path.dirname(SERVER_IN_SANDBOX)}
# The bracket keeps the grep and its shell from matching themselves.
COUNT_SERVERS = "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' '\\n' | grep -c '^/opt/berth-mcp/test_serve[r].py$'"


def require_host_python_mcp() -> None:
    """Skips (fails with BERTH_REQUIRE_BWRAP=1) unless the sandbox's
    interpreter can import the venv's ``mcp``."""
    reason = ""
    if not os.path.exists(HOST_PYTHON):
        reason = f"{HOST_PYTHON} is not installed"
    else:
        probe = subprocess.run(
            [HOST_PYTHON, "-c", "import sys, pydantic_core, mcp.server; print('%d.%d' % sys.version_info[:2])"],
            env={"PYTHONPATH": SITE_PACKAGES, "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
        )
        expected = "%d.%d" % sys.version_info[:2]
        if probe.returncode != 0 or probe.stdout.strip() != expected:
            reason = f"{HOST_PYTHON} cannot import mcp from {SITE_PACKAGES} (needs Python {expected}): {probe.stderr[-300:]}"
    if reason:
        if os.environ.get("BERTH_REQUIRE_BWRAP") == "1":
            pytest.fail(reason)
        pytest.skip(reason)


def stdio_transport(env_vars: tuple[str, ...] = (), **env: str) -> dict[str, Any]:
    """The test server as an Agents API stdio transport."""
    return {
        "type": "stdio",
        "command": HOST_PYTHON,
        "cwd": "/workspace",
        "args": [SERVER_IN_SANDBOX],
        "env": {"PYTHONPATH": SITE_IN_SANDBOX, **env},
        "env_vars": list(env_vars),
    }


@contextlib.asynccontextmanager
async def http_mcp_server(host: TestHost | None = None, *, required_bearer: str | None = None) -> AsyncIterator[str]:
    """The test server over streamable HTTP on 127.0.0.1 or, given ``host``,
    on that test host (the one place a sandbox's environment-origin server
    can be: no sandbox reaches the Berth host); yields its URL and kills the
    process on exit. With ``required_bearer`` (127.0.0.1 only) it answers 401
    to requests without that bearer token."""
    if host is not None:
        port = free_port_on(host)
        process = host.spawn([sys.executable, str(SERVER_SCRIPT), "http", str(port), "--host", "0.0.0.0"])
        await asyncio.to_thread(host.wait_listening, port, process)
        yield f"http://{host.address}:{port}/mcp"
        return
    port = free_port()
    env = {**os.environ, "MCP_REQUIRED_BEARER": required_bearer} if required_bearer else None
    server = subprocess.Popen(
        [sys.executable, str(SERVER_SCRIPT), "http", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
    )

    def listening() -> bool:
        if server.poll() is not None:
            pytest.fail("the HTTP MCP test server exited")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            return False
        return True

    try:
        await wait_until(listening, 15, what="the HTTP MCP test server to listen")
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        server.kill()
        server.wait()
