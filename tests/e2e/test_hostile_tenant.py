"""The hostile-tenant suite (issue 11): each probe runs inside a sandbox
through the public API, as a prompt-injected agent would run it, and each
must fail for the attacker. Every probe has a control that shows it works
(the target answers the host, the scan finds the tenant's own secret, the
other tenant's server answers inside its own sandbox, ...), and reports a
verdict per target so that a missing target fails the test.

Every test runs on the ``local`` backend and, marked ``docker``, on the
docker backend, both with their default settings."""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
import openai
import pytest
from e2e_stack import Stack
from e2e_support import environment_of, inline_session
from grpc_support import internal_channel
from hostile_support import (
    DISK_PROBE,
    FORK_PROBE,
    IDENTITY_PROBE,
    SCAN_PROBE,
    TCP_PROBE,
    CountingListener,
    backend_stack,
    counting_listener,
    docker_engine,  # noqa: F401 (fixture)
    docker_test_image,  # noqa: F401 (fixture)
    host_addresses,
    host_view_of,
    run_command,
    run_probe,
    sandbox_of,
)
from waiting import wait_until

from berth.environment.v1 import environment_service_pb2 as env_pb, environment_service_pb2_grpc
from berth.sandbox.v1 import sandbox_service_pb2 as sbx_pb, sandbox_service_pb2_grpc
from berth.session.v1 import session_service_pb2 as ses_pb, session_service_pb2_grpc

pytestmark = pytest.mark.timeout(120)

BACKENDS = [pytest.param("local", id="local"), pytest.param("docker", id="docker", marks=pytest.mark.docker)]
NETWORKS = ["disabled", "restricted", "enabled"]
# slirp4netns's addresses: the sandbox itself, and its gateway (which would
# be the host's loopback without --disable-host-loopback).
SLIRP_SELF, SLIRP_GATEWAY = "10.0.2.100", "10.0.2.2"
METADATA_SERVICE = ("169.254.169.254", 80)
POSTGRES = ("127.0.0.1", 5432)
MIB = 1024 * 1024


@pytest.fixture(params=BACKENDS)
async def tenant_stack(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Stack]:
    backend: str = request.param
    image: str | None = None
    if backend == "local":
        request.getfixturevalue("bwrap_available")
    else:
        image = request.getfixturevalue("docker_test_image")
    async with backend_stack(tmp_path / "berth", backend, image) as stack:
        yield stack


async def _other_organization(stack: Stack) -> openai.AsyncOpenAI:
    """A client of a second organization."""
    key: str = await stack.new_key("org-b")  # type: ignore[misc]
    return stack.aclient(key)


def _tcp_address(address: str) -> tuple[str, int] | None:
    """``host:port`` of a service address; None for a unix socket."""
    if address.startswith("unix:"):
        return None
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _control_plane(stack: Stack) -> dict[str, tuple[str, int]]:
    gateway = urlsplit(stack.base_url)
    assert gateway.hostname is not None and gateway.port is not None
    ports = {"gateway": (gateway.hostname, gateway.port)}
    for name in ("session", "environment", "sandbox"):
        address = _tcp_address(getattr(stack.settings, f"{name}_addr"))
        if address is not None:
            ports[name] = address
    return ports


async def _host_reaches(host: str, port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout=3)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


async def _settled(listener: CountingListener, expected: int) -> int:
    """The listener's count once ``expected`` connections have been accepted."""

    async def counted() -> bool:
        return len(listener.accepted) >= expected

    await wait_until(counted, timeout=5, what="the listener to accept")
    return len(listener.accepted)


@pytest.mark.parametrize("network", NETWORKS)
async def test_a_sandbox_cannot_reach_the_control_plane_the_database_or_any_host_address(
    tenant_stack: Stack, network: str
) -> None:
    client = tenant_stack.aclient()
    session = await inline_session(client, network={"access": network})
    async with counting_listener() as listener:
        port = listener.port
        controlled: dict[str, tuple[str, int]] = {**_control_plane(tenant_stack)}
        controlled["listener@127.0.0.1"] = ("127.0.0.1", port)
        controlled["listener@::1"] = ("::1", port)
        for address in host_addresses():
            controlled[f"listener@{address.interface}/{address.address}"] = (address.address, port)
        # Controls: every service port and every address of the listener
        # answers the host.
        unreachable = [label for label, (h, p) in controlled.items() if not await _host_reaches(h, p)]
        assert unreachable == []
        before = await _settled(listener, sum(1 for label in controlled if label.startswith("listener@")))
        # PostgreSQL is probed whether or not it runs here; CI runs it.
        if os.environ.get("BERTH_REQUIRE_POSTGRES") == "1":
            assert await _host_reaches(*POSTGRES)
        targets = {
            **controlled,
            "postgres": POSTGRES,
            "metadata-service": METADATA_SERVICE,
            f"listener@{SLIRP_GATEWAY}": (SLIRP_GATEWAY, port),
            f"gateway@{SLIRP_GATEWAY}": (SLIRP_GATEWAY, controlled["gateway"][1]),
        }

        probe = await run_probe(
            client, session.id, TCP_PROBE, {"targets": [[label, h, p] for label, (h, p) in targets.items()]}
        )
        result = probe.json()
        # One more host connection: once it is counted, any connection the
        # sandbox made earlier has been accepted and counted too.
        assert await _host_reaches("127.0.0.1", port)
        after = await _settled(listener, before + 1)

    verdicts: dict[str, dict[str, Any]] = result["targets"]
    assert set(verdicts) == set(targets), (set(targets) ^ set(verdicts))
    opened = {label: v for label, v in verdicts.items() if v["verdict"] == "open"}
    assert opened == {}, opened
    assert after == before + 1, listener.accepted[before:]
    if network == "restricted":
        # The egress proxy is the one way out: it answered every CONNECT
        # with a status, and refused each.
        assert result["proxy"], result
        statuses = {label: str(v.get("proxy", "")).removeprefix("proxy:") for label, v in verdicts.items()}
        assert all(len(status) == 3 and status.isdigit() for status in statuses.values()), statuses
        assert {label: status for label, status in statuses.items() if status.startswith("2")} == {}, statuses
    else:
        tunnelled = {label: v["proxy"] for label, v in verdicts.items() if str(v.get("proxy", "")).startswith("proxy:2")}
        assert tunnelled == {}, tunnelled


_WRONG_CREDENTIALS: dict[str, tuple[tuple[str, str], ...]] = {
    "nothing": (),
    "org only": (("x-berth-org", "{org}"),),
    "org and a peer name": (("x-berth-org", "{org}"), ("x-berth-peer", "{peer}")),
    "org, peer and an empty token": (("x-berth-org", "{org}"), ("x-berth-peer", "{peer}"), ("x-berth-token", "")),
    "org, peer and a wrong token": (
        ("x-berth-org", "{org}"),
        ("x-berth-peer", "{peer}"),
        ("x-berth-token", secrets.token_urlsafe(24)),
    ),
}


def _credentials(name: str, peer: str, org_id: str) -> tuple[tuple[str, str], ...]:
    return tuple(
        (key, value.replace("{peer}", peer).replace("{org}", org_id)) for key, value in _WRONG_CREDENTIALS[name]
    )


async def _stream_code(call: Any) -> tuple[grpc.StatusCode, int]:
    """The status a streaming call ends with, and how many messages came first."""
    received = 0
    try:
        async for _ in call:
            received += 1
    except grpc.aio.AioRpcError as exc:
        return exc.code(), received
    return grpc.StatusCode.OK, received


async def _unary_code(call: Any) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def test_internal_grpc_calls_without_valid_credentials_are_unauthenticated_whatever_org_they_name(
    tenant_stack: Stack,
) -> None:
    other = await _other_organization(tenant_stack)
    session = await inline_session(other, network={"access": "disabled"})
    secret = secrets.token_hex(16)
    wrote = await run_command(other, session.id, f"echo {secret} > /workspace/secret.txt")
    assert wrote.exit_code == 0, wrote
    environment_id = environment_of(session)
    sandbox_id, org_id = await sandbox_of(tenant_stack, environment_id)
    settings = tenant_stack.settings
    org_b = (("x-berth-org", org_id),)
    exec_request = sbx_pb.ExecRequest(sandbox_id=sandbox_id, argv=["cat", "/workspace/secret.txt"], timeout_ms=10_000)

    # Controls: with the deployment's credentials each call reaches org B's data.
    async with internal_channel(settings.sandbox_addr) as channel:
        sandboxes = sandbox_service_pb2_grpc.SandboxServiceStub(channel)
        listed = await sandboxes.ListLabeledSandboxes(
            sbx_pb.ListLabeledSandboxesRequest(label_key="berth.environment_id"), metadata=org_b
        )
        assert sandbox_id in [s.sandbox_id for s in listed.sandboxes]
        out = b"".join([m.chunk.data async for m in sandboxes.Exec(exec_request, metadata=org_b) if m.HasField("chunk")])
        assert out == f"{secret}\n".encode()
    async with internal_channel(settings.session_addr) as channel:
        items = await session_service_pb2_grpc.SessionServiceStub(channel).ListItems(
            ses_pb.ListItemsRequest(session_id=session.id), metadata=org_b
        )
        assert len(items.items) > 0
    async with internal_channel(settings.environment_addr) as channel:
        got = await environment_service_pb2_grpc.EnvironmentServiceStub(channel).GetEnvironment(
            env_pb.GetEnvironmentRequest(environment_id=environment_id), metadata=org_b
        )
        assert got.environment.id == environment_id

    codes: dict[str, grpc.StatusCode] = {}
    async with (
        grpc.aio.insecure_channel(settings.sandbox_addr) as sandbox_channel,
        grpc.aio.insecure_channel(settings.session_addr) as session_channel,
        grpc.aio.insecure_channel(settings.environment_addr) as environment_channel,
    ):
        sandboxes = sandbox_service_pb2_grpc.SandboxServiceStub(sandbox_channel)
        sessions = session_service_pb2_grpc.SessionServiceStub(session_channel)
        environments = environment_service_pb2_grpc.EnvironmentServiceStub(environment_channel)
        for name in _WRONG_CREDENTIALS:
            # Each service is told it is called by the peer that may call it.
            as_environment = _credentials(name, "environment", org_id)
            as_gateway = _credentials(name, "gateway", org_id)
            codes[f"sandbox.ListLabeledSandboxes, {name}"] = await _unary_code(
                sandboxes.ListLabeledSandboxes(
                    sbx_pb.ListLabeledSandboxesRequest(label_key="berth.environment_id"), metadata=as_environment, timeout=10
                )
            )
            code, received = await _stream_code(sandboxes.Exec(exec_request, metadata=as_environment, timeout=10))
            assert received == 0, name
            codes[f"sandbox.Exec, {name}"] = code
            codes[f"session.ListItems, {name}"] = await _unary_code(
                sessions.ListItems(ses_pb.ListItemsRequest(session_id=session.id), metadata=as_gateway, timeout=10)
            )
            codes[f"environment.GetEnvironment, {name}"] = await _unary_code(
                environments.GetEnvironment(
                    env_pb.GetEnvironmentRequest(environment_id=environment_id), metadata=as_gateway, timeout=10
                )
            )

    assert len(codes) == 4 * len(_WRONG_CREDENTIALS)
    assert {call: code for call, code in codes.items() if code != grpc.StatusCode.UNAUTHENTICATED} == {}


async def test_a_sandbox_runs_as_an_unprivileged_user_without_capabilities_and_cannot_read_the_hosts_shadow_file(
    tenant_stack: Stack,
) -> None:
    client = tenant_stack.aclient()
    session = await inline_session(client)
    assert Path("/etc/shadow").exists()  # the host's file is there to be read
    marker = f"hostile-id-{secrets.token_hex(8)}"
    sleeper = await run_command(
        client, session.id, f"nohup python3 -c 'import time; time.sleep(120)' {marker} >/dev/null 2>&1 &"
    )
    assert sleeper.exit_code == 0, sleeper

    result = (await run_probe(client, session.id, IDENTITY_PROBE)).json()
    # From inside, a user namespace shows only its parent's ids: the host
    # itself tells which host uid a sandbox's process has.
    seen_from_host = host_view_of(marker)

    assert result["uid"] != 0 and result["euid"] != 0 and result["gid"] != 0, result
    assert result["id_u"] == [0, str(result["uid"])], result
    assert result["caps"] == {k: "0000000000000000" for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")}
    assert len(seen_from_host) == 1, seen_from_host  # control: the host found the sandbox's process
    (host_status,) = seen_from_host
    assert "0" not in host_status["Uid"] and "0" not in host_status["Gid"], host_status
    assert host_status["CapEff"] == ["0000000000000000"], host_status
    files = result["files"]
    assert files["/etc/passwd"] == "readable"  # control: the probe reads files
    for path in ("/etc/shadow", "/etc/gshadow"):
        assert files[path] == "absent" or files[path].startswith("unreadable:"), files


async def _plant_secret(client: openai.AsyncOpenAI, session_id: str, secret: str) -> None:
    """A file named after ``secret`` holding it, and a background process
    carrying it in its command line (its environment already has it)."""
    planted = await run_command(
        client,
        session_id,
        f"echo {secret} > {secret}.txt && "
        f"nohup python3 -c 'import time; time.sleep(300)' {secret} >/dev/null 2>&1 &",
    )
    assert planted.exit_code == 0, planted


# The scan walks ~145,000 names (the host's /usr among them): about 4 s on an
# idle machine, but it once took over 40 s under a loaded CI run.
_SCAN_LIMIT_S = 180


async def test_a_sandbox_finds_no_trace_of_another_organizations_workspace_or_processes(tenant_stack: Stack) -> None:
    mine = tenant_stack.aclient()
    theirs = await _other_organization(tenant_stack)
    my_secret, their_secret = f"hostile-a-{secrets.token_hex(8)}", f"hostile-b-{secrets.token_hex(8)}"
    their_session = await inline_session(theirs, env={"HOSTILE_MARK": their_secret})
    my_session = await inline_session(mine, env={"HOSTILE_MARK": my_secret})
    await _plant_secret(theirs, their_session.id, their_secret)
    await _plant_secret(mine, my_session.id, my_secret)
    their_sandbox, _ = await sandbox_of(tenant_stack, environment_of(their_session))
    data_dir = tenant_stack.data_dir.resolve()
    their_home = data_dir / "sandboxes" / their_sandbox
    assert (their_home / "workspace" / f"{their_secret}.txt").is_file()  # where it lives on the host
    host_paths = [str(their_home), str(their_home / "workspace"), str(data_dir)]

    attack = await run_probe(
        mine,
        my_session.id,
        SCAN_PROBE,
        {
            "needles": {"mine": my_secret, "theirs": their_secret, "their_sandbox": their_sandbox},
            "paths": host_paths,
            "time_limit_s": _SCAN_LIMIT_S,
        },
        timeout=_SCAN_LIMIT_S + 60,
    )
    control = await run_probe(
        theirs,
        their_session.id,
        SCAN_PROBE,
        {"needles": {"mine": their_secret}, "paths": [], "time_limit_s": _SCAN_LIMIT_S},
        timeout=_SCAN_LIMIT_S + 60,
    )
    found, theirs_found = attack.json(), control.json()

    assert found["hits"]["theirs"] == [] and found["hits"]["their_sandbox"] == [], found["hits"]
    assert found["present"] == {path: False for path in host_paths}
    assert found["complete"] and theirs_found["complete"], (found, theirs_found)
    # Controls: the same scan finds each tenant's own secret by name, by
    # content and in its processes, in its own sandbox.
    for scan in (found, theirs_found):
        kinds = {hit.split(":", 1)[0] for hit in scan["hits"]["mine"]}
        assert {"name", "content", "proc"} <= kinds, scan["hits"]["mine"]
        assert scan["walked"] > 1000 and scan["pids"] >= 2, scan


async def test_a_sandbox_cannot_reach_another_organizations_sandbox_over_the_network(tenant_stack: Stack) -> None:
    mine = tenant_stack.aclient()
    theirs = await _other_organization(tenant_stack)
    their_session = await inline_session(theirs, network={"access": "enabled"})
    my_session = await inline_session(mine, network={"access": "enabled"})
    marker, port = f"hostile-web-{secrets.token_hex(8)}", 8765
    served = await run_command(
        theirs,
        their_session.id,
        f"touch /workspace/{marker} && "
        f"nohup python3 -m http.server {port} --bind 0.0.0.0 --directory /workspace >/dev/null 2>&1 &",
    )
    assert served.exit_code == 0, served

    # Control: the server answers inside its own sandbox, on each of its addresses.
    inside = (
        await run_probe(
            theirs,
            their_session.id,
            TCP_PROBE,
            {"targets": [], "wait": ["127.0.0.1", port], "own_port": port, "marker": marker},
        )
    ).json()
    their_addresses: list[str] = inside["own_addresses"]
    assert "127.0.0.1" in their_addresses and len(their_addresses) >= 2, inside
    assert {label: v for label, v in inside["targets"].items() if not v.get("reply_has_marker")} == {}, inside
    assert set(inside["targets"]) == {f"own:{a}" for a in their_addresses}

    targets = {f"theirs@{a}": [a, port] for a in their_addresses}
    targets[f"slirp@{SLIRP_SELF}"] = [SLIRP_SELF, port]
    targets[f"slirp-gateway@{SLIRP_GATEWAY}"] = [SLIRP_GATEWAY, port]
    targets.update({f"host@{a.interface}/{a.address}": [a.address, port] for a in host_addresses()})
    attack = (
        await run_probe(
            mine, my_session.id, TCP_PROBE, {"targets": [[label, *t] for label, t in targets.items()], "marker": marker}
        )
    ).json()

    verdicts: dict[str, dict[str, Any]] = attack["targets"]
    assert set(verdicts) == set(targets)
    assert {label: v for label, v in verdicts.items() if v["verdict"] == "open" or v.get("reply_has_marker")} == {}


def _small(network: str = "disabled") -> dict[str, Any]:
    return {"container_size": "small", "network": {"access": network}}


async def test_a_command_past_the_small_memory_limit_is_killed_and_the_environment_goes_on(tenant_stack: Stack) -> None:
    client = tenant_stack.aclient()
    session = await inline_session(client, **_small())
    allocate = "python3 -c \"b = b'x' * ({mib} << 20); print('allocated', len(b) >> 20)\""

    modest = await run_command(client, session.id, allocate.format(mib=64))
    hog = await run_command(client, session.id, allocate.format(mib=1536))
    after = await run_command(client, session.id, "echo still-here")

    assert (modest.exit_code, modest.output) == (0, "allocated 64\n"), modest  # control
    assert hog.exit_code not in (0, None) and "allocated" not in hog.output, hog
    assert (after.exit_code, after.output) == (0, "still-here\n"), after


async def test_a_fork_bomb_stops_at_the_small_pids_limit_and_the_environment_goes_on(tenant_stack: Stack) -> None:
    client = tenant_stack.aclient()
    session = await inline_session(client, **_small())

    bomb = (await run_probe(client, session.id, FORK_PROBE, {"max": 2000})).json()
    after = await run_command(client, session.id, "echo alive")

    assert bomb["refused"] == "EAGAIN", bomb
    # Control: it did fork, well past a handful, and stopped below the limit.
    assert 128 <= bomb["forked"] < 256, bomb
    assert (after.exit_code, after.output) == (0, "alive\n"), after


async def test_a_write_past_the_small_disk_quota_fails_with_enospc_and_the_environment_goes_on(
    tenant_stack: Stack,
) -> None:
    # Filling 4 GiB byte by byte is too slow here: the probe preallocates
    # all but 32 MiB (fast, no data is written), then really writes past the
    # rest. tests/sandbox/test_local_isolation.py writes a small quota full.
    client = tenant_stack.aclient()
    session = await inline_session(client, **_small())

    disk = (await run_probe(client, session.id, DISK_PROBE, {"write_mib": 256}, timeout=90)).json()
    after = await run_command(client, session.id, "echo ok > /workspace/after && cat /workspace/after")

    assert 3584 <= disk["total_mib"] <= 4096, disk  # the small size's workspace, not the host's disk
    assert disk["allocate_past_size"] == "ENOSPC", disk
    assert disk["preallocated_mib"] >= 3000, disk  # control: space is there up to the quota
    assert disk["write_past_quota"] == "ENOSPC" and disk["written_mib"] < 64, disk
    assert (after.exit_code, after.output) == (0, "ok\n"), after
