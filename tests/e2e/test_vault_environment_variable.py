"""``environment_variable`` vault credentials (issue 16): the sandbox sees a
placeholder, and its egress proxy puts the real secret into HTTPS requests
to the credential's allowed hosts only. Two TLS servers on the host's
loopback, both on port 8443 (a substitution port): ``localhost`` is the
allowed host and answers 200 only to the real bearer; ``127.0.0.2`` is
allowed by the network policy but not by the credential, and records what
reaches it. Their certificates come from a test CA that sandboxes trust
(``sandbox_ca_bundle``); the egress proxy verifies them with the same."""

from __future__ import annotations

import asyncio
import io
import ipaddress
import json
import socket
import ssl
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from cryptography import x509
from e2e_stack import Stack, start_stack
from e2e_support import api_error, environment_of, run_script, sandbox_dirs
from hostile_support import docker_engine, docker_test_image, run_command, run_probe  # noqa: F401 (fixtures)
from tls_support import FakeCA, fake_ca

from services.core.logging import capture_json_logs

pytestmark = pytest.mark.timeout(120)

SECRET = "real-env-secret-4b9e01c7d2"
PORT = 8443
ALLOWED, OTHER = "localhost", "127.0.0.2"
BACKENDS = [pytest.param("local", id="local"), pytest.param("docker", id="docker", marks=pytest.mark.docker)]


# --- TLS servers from a test CA ----------------------------------------------------------------


@dataclass
class Server:
    """What reached one TLS server: the Authorization header of each request."""

    authorizations: list[str] = field(default_factory=list)


async def _serve(server: Server, require: str | None, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
        writer.close()
        return
    headers = dict(
        (name.strip().lower(), value.strip())
        for name, _, value in (line.partition(":") for line in head.decode("latin-1").split("\r\n")[1:] if line)
    )
    server.authorizations.append(headers.get("authorization", ""))
    ok = require is None or headers.get("authorization") == require
    body = b"welcome" if ok else b"unauthorized"
    status = b"200 OK" if ok else b"401 Unauthorized"
    writer.write(b"HTTP/1.1 %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (status, len(body), body))
    with _quiet():
        await writer.drain()
        writer.close()


@contextmanager
def _quiet() -> Iterator[None]:
    try:
        yield
    except (ConnectionError, ssl.SSLError):
        pass


@asynccontextmanager
async def tls_server(
    ca: FakeCA, address: str, san: x509.GeneralName, directory: Path, require: str | None
) -> AsyncIterator[Server]:
    server = Server()
    try:
        listening = await asyncio.start_server(
            lambda r, w: _serve(server, require, r, w),
            address,
            PORT,
            family=socket.AF_INET,
            ssl=ca.server_context(san, directory),
        )
    except OSError as exc:
        pytest.fail(f"the test server needs {address}:{PORT} free: {exc}")
    try:
        yield server
    finally:
        listening.close()
        await listening.wait_closed()


# --- the stack ----------------------------------------------------------------------------------


@dataclass
class Setup:
    stack: Stack
    allowed: Server
    other: Server


@pytest.fixture(params=BACKENDS)
async def setup(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Setup]:
    overrides: dict[str, Any] = {"sandbox_egress_allow_private": True}
    if request.param == "local":
        request.getfixturevalue("bwrap_available")
    else:
        overrides |= {"sandbox_backend": "docker", "docker_image": request.getfixturevalue("docker_test_image")}
    with fake_ca() as ca:
        async with (
            tls_server(ca, "127.0.0.1", x509.DNSName(ALLOWED), tmp_path, f"Bearer {SECRET}") as allowed,
            tls_server(ca, OTHER, x509.IPAddress(ipaddress.ip_address(OTHER)), tmp_path, None) as other,
        ):
            stack, stop = await start_stack(tmp_path / "berth", sandbox_ca_bundle=str(ca.bundle), **overrides)
            try:
                yield Setup(stack, allowed, other)
            finally:
                await stop()  # type: ignore[misc]
                if request.param == "docker":
                    from services.sandbox.backends.docker import DockerBackend

                    reaper = DockerBackend(stack.settings)
                    for handle in await reaper.adopt():
                        await reaper.destroy(handle)
                    await reaper.close()


async def _vault_with_secret(client: openai.AsyncOpenAI, networking: dict[str, Any]) -> tuple[str, str]:
    vault = await client.beta.agents.vaults.create(name="env")
    credential = await client.beta.agents.vaults.credentials.create(
        vault.id,
        name="api",
        auth={"type": "environment_variable", "secret_name": "API_TOKEN", "secret_value": SECRET, "networking": networking},  # type: ignore[typeddict-item]
    )
    return vault.id, credential.id


_RESTRICTED: Any = {"access": "restricted", "allowed_domains": [ALLOWED, OTHER]}

# Sends the placeholder as a bearer to both servers with urllib through the
# egress proxy (NO_PROXY names localhost, which is the host's here).
_FETCH = f"""
import json, os, urllib.error, urllib.request
for name in ("NO_PROXY", "no_proxy"):
    os.environ.pop(name, None)
out = {{}}
for url in ("https://{ALLOWED}:{PORT}/a", "https://{OTHER}:{PORT}/b"):
    request = urllib.request.Request(url, headers={{"Authorization": "Bearer " + os.environ["API_TOKEN"]}})
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            out[url] = [response.status, response.read().decode()]
    except urllib.error.HTTPError as exc:
        out[url] = [exc.code, exc.read().decode()]
    except Exception as exc:
        out[url] = ["error", repr(exc)]
print(json.dumps(out))
"""


async def _everything_visible(stack: Stack, session_id: str, vault_id: str, turns: int) -> str:
    bodies: list[str] = []
    async with stack.http() as http:
        for path in (
            f"/agents/sessions/{session_id}",
            f"/agents/sessions/{session_id}/items",
            f"/agents/sessions/{session_id}/turns",
            f"/vaults/{vault_id}/credentials",
        ):
            bodies.append((await http.get(path)).text)
        ended = 0
        async with http.stream("GET", f"/agents/sessions/{session_id}/events", headers={"Last-Event-ID": "0"}) as events:
            async for line in events.aiter_lines():
                bodies.append(line)
                ended += "turn.completed" in line or "turn.failed" in line
                if ended >= turns:
                    break
    return "\n".join(bodies)


async def _use_the_secret(setup: Setup) -> str:
    client = setup.stack.aclient()
    vault_id, _ = await _vault_with_secret(client, {"type": "limited", "allowed_hosts": [ALLOWED]})
    session = await client.beta.agents.sessions.create(
        agent={"model": "scripted"},
        environment={"type": "openai_hosted", "network": _RESTRICTED},
        vault_ids=[vault_id],
    )

    shown = await run_command(client, session.id, "env; echo; tr '\\0' '\\n' < /proc/self/environ; cat /run/berth/env.json")
    assert shown.exit_code == 0, shown
    placeholders = {line.split("=", 1)[1] for line in shown.output.splitlines() if line.startswith("API_TOKEN=")}
    assert len(placeholders) == 1, shown.output
    placeholder = placeholders.pop()
    assert placeholder.startswith("berth-secret-") and SECRET not in shown.output

    fetched = await run_probe(client, session.id, _FETCH)
    assert fetched.exit_code == 0, fetched
    results = json.loads(fetched.output.strip().splitlines()[-1])
    # The allowed host saw the real secret; the other got only the placeholder.
    assert results[f"https://{ALLOWED}:{PORT}/a"] == [200, "welcome"], results
    assert results[f"https://{OTHER}:{PORT}/b"] == [200, "welcome"], results
    assert setup.allowed.authorizations == [f"Bearer {SECRET}"]
    assert setup.other.authorizations == [f"Bearer {placeholder}"]

    # A curl from the shell, too, when the sandbox has one.
    curled = await run_command(
        client,
        session.id,
        f'command -v curl >/dev/null || {{ echo no-curl; exit 0; }}; NO_PROXY= no_proxy= curl -sS -H "Authorization: Bearer $API_TOKEN" https://{ALLOWED}:{PORT}/c',
    )
    assert curled.output.strip() in ("welcome", "no-curl"), curled

    visible = await _everything_visible(setup.stack, session.id, vault_id, turns=3)
    assert placeholder in visible
    assert SECRET not in visible
    return environment_of(session)


async def test_the_sandbox_sees_a_placeholder_and_only_the_allowed_host_receives_the_secret(setup: Setup) -> None:
    logs = io.StringIO()
    with capture_json_logs(logs, level="DEBUG"):
        await _use_the_secret(setup)
    assert "egress_substitution_started" in logs.getvalue()
    assert SECRET not in logs.getvalue()
    for path in setup.stack.data_dir.rglob("*"):
        # Workspace images are the disk quota's sparse files: what commands wrote, which the outputs show.
        if path.is_file() and not path.is_symlink() and path.suffix != ".ext4":
            assert SECRET.encode() not in path.read_bytes(), path


@pytest.mark.parametrize("setup", ["local"], indirect=True)
async def test_a_restarted_sandbox_service_keeps_substituting(setup: Setup) -> None:
    client = setup.stack.aclient()
    vault_id, _ = await _vault_with_secret(client, {"type": "unrestricted"})
    session = await client.beta.agents.sessions.create(
        agent={"model": "scripted"},
        environment={"type": "openai_hosted", "network": _RESTRICTED},
        vault_ids=[vault_id],
    )
    assert (await run_command(client, session.id, "true")).exit_code == 0
    await setup.stack.stop_sandbox()  # type: ignore[misc]
    await setup.stack.start_sandbox()  # type: ignore[misc]
    fetched = await run_probe(client, session.id, _FETCH)
    results = json.loads(fetched.output.strip().splitlines()[-1])
    # Unrestricted networking: every host the policy allows gets the secret.
    assert results[f"https://{ALLOWED}:{PORT}/a"] == [200, "welcome"], results
    assert setup.allowed.authorizations == [f"Bearer {SECRET}"]
    assert setup.other.authorizations == [f"Bearer {SECRET}"]


# --- refusals (no sandbox is made) --------------------------------------------------------------


@pytest.mark.parametrize(
    ("network", "networking"),
    [
        ({"access": "enabled"}, {"type": "limited", "allowed_hosts": [ALLOWED]}),
        ({"access": "disabled"}, {"type": "limited", "allowed_hosts": [ALLOWED]}),
        (None, {"type": "limited", "allowed_hosts": [ALLOWED]}),
        ({"access": "restricted"}, {"type": "unrestricted"}),
    ],
    ids=["enabled", "disabled", "default", "unrestricted-without-allowed-domains"],
)
async def test_an_environment_whose_network_cannot_substitute_is_refused_when_it_selects_the_vault(
    stack: Stack, network: dict[str, Any] | None, networking: dict[str, Any]
) -> None:
    client = stack.aclient()
    vault_id, _ = await _vault_with_secret(client, networking)
    environment: Any = {"type": "openai_hosted"} | ({"network": network} if network else {})
    for create in (
        client.beta.agents.sessions.create(agent={"model": "scripted"}, environment=environment, vault_ids=[vault_id]),
        client.beta.agents.environments.create(environment=environment, vault_ids=[vault_id]),  # type: ignore[arg-type, call-arg]
    ):
        refused = await api_error(create)
        assert (refused.status_code, refused.code, refused.body["param"]) == (400, "validation_error", "vault_ids")  # type: ignore[index]
    assert [s async for s in client.beta.agents.sessions.list()] == []


async def test_a_secret_added_later_to_the_vault_of_an_enabled_network_environment_fails_its_setup_closed(
    stack: Stack,
) -> None:
    client = stack.aclient()
    vault = await client.beta.agents.vaults.create(name="later")
    session = await client.beta.agents.sessions.create(
        agent={"model": "scripted"},
        environment={"type": "openai_hosted", "network": {"access": "enabled"}},  # type: ignore[typeddict-item]
        vault_ids=[vault.id],
    )
    await client.beta.agents.vaults.credentials.create(
        vault.id,
        name="api",
        auth={"type": "environment_variable", "secret_name": "API_TOKEN", "secret_value": SECRET, "networking": {"type": "unrestricted"}},  # type: ignore[typeddict-item]
    )
    turn = await run_script(client, session.id, "$ env")
    assert turn.status == "failed", turn
    environment = await client.beta.agents.environments.retrieve(environment_of(session))
    assert environment.status == "failed", environment  # type: ignore[attr-defined]
    assert not sandbox_dirs(stack.data_dir), "no sandbox was made"
    async with stack.http() as http:
        bodies = [(await http.get(p)).text for p in (f"/agents/sessions/{session.id}/items", f"/agents/environments/{environment.id}")]
    assert "network.access restricted" in "".join(bodies) and SECRET not in "".join(bodies)


async def test_an_environment_variable_credential_shows_its_name_and_networking_and_rotates_write_only(stack: Stack) -> None:
    client = stack.aclient()
    vault_id, credential_id = await _vault_with_secret(client, {"type": "limited", "allowed_hosts": ["API.example.com", "10.0.0.1"]})
    shown = await client.beta.agents.vaults.credentials.retrieve(credential_id, vault_id=vault_id)
    assert shown.auth.model_dump() == {
        "type": "environment_variable",
        "secret_name": "API_TOKEN",
        "networking": {"type": "limited", "allowed_hosts": ["api.example.com", "10.0.0.1"]},
    }
    rotated = await client.beta.agents.vaults.credentials.update(
        credential_id, vault_id=vault_id, auth={"type": "environment_variable", "secret_value": "rotated-value-93ab"}
    )
    assert rotated.auth == shown.auth
    empty = await api_error(
        client.beta.agents.vaults.credentials.update(
            credential_id, vault_id=vault_id, auth={"type": "environment_variable", "secret_value": ""}
        )
    )
    assert (empty.status_code, empty.body["param"]) == (400, "auth.secret_value")  # type: ignore[index]
    async with stack.http() as http:
        body = (await http.get(f"/vaults/{vault_id}/credentials")).text
    assert SECRET not in body and "rotated-value-93ab" not in body


# --- rotation and deletion reach the running sandbox ---------------------------------------------

ROTATED = "rotated-env-secret-71c3aa"


async def _fetch_allowed(client: openai.AsyncOpenAI, session_id: str) -> None:
    fetched = await run_probe(client, session_id, _FETCH)
    assert fetched.exit_code == 0, fetched


async def _placeholder(client: openai.AsyncOpenAI, session_id: str) -> str:
    shown = await run_command(client, session_id, "printenv API_TOKEN")
    assert shown.exit_code == 0, shown
    return shown.output.strip()


async def test_a_rotated_secret_reaches_the_running_sandbox_and_a_deleted_one_only_its_placeholder(setup: Setup) -> None:
    client = setup.stack.aclient()
    vault_id, credential_id = await _vault_with_secret(client, {"type": "limited", "allowed_hosts": [ALLOWED]})
    session = await client.beta.agents.sessions.create(
        agent={"model": "scripted"},
        environment={"type": "openai_hosted", "network": _RESTRICTED},
        vault_ids=[vault_id],
    )
    placeholder = await _placeholder(client, session.id)
    await _fetch_allowed(client, session.id)
    assert setup.allowed.authorizations == [f"Bearer {SECRET}"]

    await client.beta.agents.vaults.credentials.update(
        credential_id, vault_id=vault_id, auth={"type": "environment_variable", "secret_value": ROTATED}
    )
    await _fetch_allowed(client, session.id)
    assert setup.allowed.authorizations[1:] == [f"Bearer {ROTATED}"]
    # The other host still gets the placeholder, and the variable is unchanged.
    assert setup.other.authorizations == [f"Bearer {placeholder}"] * 2
    assert await _placeholder(client, session.id) == placeholder

    await client.beta.agents.vaults.credentials.delete(credential_id, vault_id=vault_id)
    await _fetch_allowed(client, session.id)
    assert setup.allowed.authorizations[2:] == [f"Bearer {placeholder}"]


@pytest.mark.parametrize("setup", ["local"], indirect=True)
async def test_a_rotation_survives_a_sandbox_service_restart_and_a_deletion_it_cannot_apply_is_refused(
    setup: Setup,
) -> None:
    client = setup.stack.aclient()
    vault_id, credential_id = await _vault_with_secret(client, {"type": "limited", "allowed_hosts": [ALLOWED]})
    session = await client.beta.agents.sessions.create(
        agent={"model": "scripted"},
        environment={"type": "openai_hosted", "network": _RESTRICTED},
        vault_ids=[vault_id],
    )
    placeholder = await _placeholder(client, session.id)
    await client.beta.agents.vaults.credentials.update(
        credential_id, vault_id=vault_id, auth={"type": "environment_variable", "secret_value": ROTATED}
    )
    await setup.stack.stop_sandbox()  # type: ignore[misc]
    # Unreachable: the deletion fails clearly and deletes nothing.
    for delete in (
        client.beta.agents.vaults.credentials.delete(credential_id, vault_id=vault_id),
        client.beta.agents.vaults.delete(vault_id),
    ):
        refused = await api_error(delete)
        assert (refused.status_code, refused.code) == (503, "sandbox_unavailable")
    assert (await client.beta.agents.vaults.credentials.retrieve(credential_id, vault_id=vault_id)).id == credential_id
    await setup.stack.start_sandbox()  # type: ignore[misc]

    await _fetch_allowed(client, session.id)
    assert setup.allowed.authorizations == [f"Bearer {ROTATED}"]
    await client.beta.agents.vaults.delete(vault_id)
    await _fetch_allowed(client, session.id)
    assert setup.allowed.authorizations[1:] == [f"Bearer {placeholder}"]
    assert SECRET not in "".join(setup.allowed.authorizations + setup.other.authorizations)
