"""The ``berth`` command: ``serve``, ``keys``, ``status``, ``mcp`` and ``token``.

``berth serve`` is the embedded default: all four servers, each in a process
of its own under one supervisor (services/supervisor.py) running its
stand-alone ``__main__``, or with ``BERTH_SERVE_PROCESSES=false`` all in this
process, built by the same factories, on SQLite
under ``BERTH_DATA_DIR`` and the local sandbox backend. Its gRPC services
listen on unix sockets in ``<data_dir>/control`` (mode 0700, which no sandbox
mounts) unless their ``*_ADDR`` is set, and use a fresh internal token per
run unless one is configured; the token is left in
``control/internal.token`` (0600) for ``berth status`` and ``berth mcp``,
which dial the same addresses.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import socket
import stat
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import SecretStr

from services.core.context import InternalTokenMissing, PeerCredentials
from services.core.grpc_server import open_channel
from services.core.logging import configure_logging, get_logger
from services.core.settings import Settings

__all__ = ["main"]

log = get_logger("berth.cli")

ALL_SCOPES = ("tasks:read", "tasks:write")

_CONTROL_DIR = "control"
_TOKEN_FILE = "internal.token"
_EMBEDDED_SERVICES = ("session", "environment", "sandbox")
# sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
_MAX_SOCKET_PATH = 107


class ServeRefused(Exception):
    """``berth serve`` refuses to start: its control directory cannot be made
    safe, or this host cannot confine sandboxes."""


def _control_path(settings: Settings) -> Path:
    return settings.data_dir.resolve() / _CONTROL_DIR


def _socket_addresses(settings: Settings) -> dict[str, object]:
    """Each embedded service whose ``*_ADDR`` is not configured listens on
    (and is dialled at) a unix socket in the control directory."""
    control = _control_path(settings)
    return {
        f"{name}_addr": f"unix:{control / f'{name}.sock'}"
        for name in _EMBEDDED_SERVICES
        if f"{name}_addr" not in settings.model_fields_set
    }


def _token_configured(settings: Settings) -> bool:
    return bool(settings.internal_token.get_secret_value()) or settings.internal_token_file is not None


def _private_control_dir(settings: Settings) -> Path:
    """Creates ``<data_dir>/control`` as 0700, or makes an existing one 0700;
    refuses a symlink or a directory another user owns."""
    path = _control_path(settings)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise ServeRefused(f"{path} is not a directory")
    if info.st_uid != os.getuid():
        raise ServeRefused(f"{path} is owned by uid {info.st_uid}, not by this user (uid {os.getuid()})")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def _check_sockets(addresses: dict[str, object]) -> None:
    for address in addresses.values():
        path = str(address).removeprefix("unix:")
        if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
            raise ServeRefused(
                f"socket path {path} is longer than {_MAX_SOCKET_PATH} bytes: use a shorter BERTH_DATA_DIR "
                "or set BERTH_SESSION_ADDR, BERTH_ENVIRONMENT_ADDR and BERTH_SANDBOX_ADDR"
            )
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            # Binding would silently take the socket over from a running serve.
            if probe.connect_ex(path) == 0:
                raise ServeRefused(f"{path} is in use: another berth serve runs on this data directory")


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as file:
        os.fchmod(fd, 0o600)
        file.write(text + "\n")


def _serve_settings(settings: Settings) -> Settings:
    """The settings ``berth serve`` runs with: control sockets and a token."""
    control = _private_control_dir(settings)
    updates = _socket_addresses(settings)
    _check_sockets(updates)
    if not _token_configured(settings):
        token = secrets.token_urlsafe(32)
        _write_private(control / _TOKEN_FILE, token)
        updates["internal_token"] = SecretStr(token)
    return settings.model_copy(update=updates)


def _client_settings(settings: Settings) -> Settings:
    """The settings the CLI dials a ``berth serve`` with: the same addresses,
    and its per-run token when none is configured."""
    updates = _socket_addresses(settings)
    token_file = _control_path(settings) / _TOKEN_FILE
    if not _token_configured(settings) and token_file.is_file():
        updates["internal_token_file"] = token_file
    return settings.model_copy(update=updates)


def _local_isolation(settings: Settings) -> bool:
    return settings.sandbox_backend == "local" and settings.sandbox_isolation == "bwrap"


def _require_isolation(settings: Settings) -> None:
    """Refuses to serve, before anything listens, on a host that cannot
    confine local sandboxes; as root with apt it installs what is missing."""
    from services.sandbox.isolation.preflight import (
        can_install,
        check_local_host,
        install_command,
        install_missing,
        missing_packages,
    )

    if not _local_isolation(settings):
        return
    missing = missing_packages()
    if missing:
        if can_install():
            print(f"berth serve: sandbox isolation needs {' '.join(missing)}; installing them with apt-get", flush=True)
        if not install_missing():
            raise ServeRefused(
                f"sandbox isolation needs packages that are not installed: {' '.join(missing)}. "
                f"Run as root: {install_command(missing_packages())} "
                "(or set BERTH_SANDBOX_ISOLATION=none for development only)"
            )
    failed = [check for check in check_local_host() if not check.ok]
    if failed:
        reasons = "; ".join(f"{check.piece}: {check.detail}" for check in failed)
        raise ServeRefused(
            f"this host cannot confine sandboxes ({reasons}). "
            "Set BERTH_SANDBOX_ISOLATION=none for development only."
        )


async def _serve(settings: Settings) -> None:
    _require_isolation(settings)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    token_made = not _token_configured(settings)
    settings = _serve_settings(settings)
    if settings.serve_processes:
        await _serve_processes(settings, token_made=token_made)
    else:
        await _serve_one_process(settings)


def _print_banner(settings: Settings, port: int, key: str | None) -> None:
    base = f"http://{settings.gateway_host}:{port}"
    print(f"Berth is running at {base}/v1 (data in {settings.data_dir.resolve()})", flush=True)
    if settings.sandbox_isolation == "none":
        print("WARNING: BERTH_SANDBOX_ISOLATION=none: sandboxes run unconfined on this host.", flush=True)
    if key is not None:
        print(f"Created organization {settings.dev_org!r} with API key (shown once):\n  {key}", flush=True)
        print(
            "Try it:\n"
            f"  curl -s {base}/v1/agents/environments \\\n"
            f"    -H 'Authorization: Bearer {key}' -H 'OpenAI-Beta: agents=v1' \\\n"
            "    -H 'Content-Type: application/json' -d '{\"environment\":{\"type\":\"openai_hosted\"}}'",
            flush=True,
        )
    else:
        print(f"Organization {settings.dev_org!r} exists; create a key with: berth keys create --org {settings.dev_org}", flush=True)


async def _serve_one_process(settings: Settings) -> None:
    """All four servers in this process and its event loop."""
    settings = settings.model_copy(update={"session_sole_writer": True})
    from gateway.app import start_gateway
    from gateway.keys import ensure_dev_key
    from services.core.grpc_server import wait_for_termination_signal
    from services.core.metrics import start_metrics_server
    from services.core.service import settle_heap
    from services.environment.server import start_environment_service
    from services.sandbox.server import start_sandbox_service
    from services.session.server import start_session_service

    start_metrics_server(settings.metrics_port)
    # Each service may listen on port 0; the next one dials the real address.
    sandbox = await start_sandbox_service(settings)
    settings = settings.model_copy(update={"sandbox_addr": _actual(settings.sandbox_addr, sandbox.port)})
    environment = await start_environment_service(settings)
    settings = settings.model_copy(update={"environment_addr": _actual(settings.environment_addr, environment.port)})
    session = await start_session_service(settings)
    settings = settings.model_copy(update={"session_addr": _actual(settings.session_addr, session.port)})
    gateway = await start_gateway(settings)
    settle_heap()
    try:
        _print_banner(settings, gateway.port, await ensure_dev_key(gateway.database, settings.dev_org))
        await wait_for_termination_signal()
    finally:
        await gateway.stop()
        await session.stop(settings.grace_s)
        await environment.stop(settings.grace_s)
        await sandbox.stop(settings.grace_s)


# The supervisor stops them in the reverse of this order, the gateway first.
_CHILDREN = (("sandbox", "services.sandbox"), ("environment", "services.environment"), ("session", "services.session"))


def _bound_port(address: str) -> str:
    """A TCP address with port 0 gets a free port now: every child must know
    the others' addresses before they start."""
    if address.startswith("unix:") or not address.endswith(":0"):
        return address
    return f"{address.rsplit(':', 1)[0]}:{_free_port()}"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _child_env(settings: Settings, lifeline_fd: int, *, token_made: bool) -> dict[str, str]:
    env = {
        **os.environ,
        "BERTH_DATA_DIR": str(settings.data_dir.resolve()),
        "BERTH_GATEWAY_PORT": str(settings.gateway_port),
        "BERTH_SANDBOX_ADDR": settings.sandbox_addr,
        "BERTH_ENVIRONMENT_ADDR": settings.environment_addr,
        "BERTH_SESSION_ADDR": settings.session_addr,
        "BERTH_SERVE_LIFELINE_FD": str(lifeline_fd),
        # One Session service writes its SQLite database: its followers need not poll it.
        "BERTH_SESSION_SOLE_WRITER": "true",
    }
    if token_made:
        # The children read the token berth serve made from its file, not from their environment.
        env.pop("BERTH_INTERNAL_TOKEN", None)
        env["BERTH_INTERNAL_TOKEN_FILE"] = str(_control_path(settings) / _TOKEN_FILE)
    return env


async def _serve_processes(settings: Settings, *, token_made: bool) -> None:
    """Each service in a process of its own (services/supervisor.py)."""
    from gateway.keys import ensure_dev_key, open_gateway_database
    from services.core.grpc_server import wait_for_termination_signal
    from services.supervisor import Child, ChildFailed, Supervisor

    settings = settings.model_copy(
        update={
            "sandbox_addr": _bound_port(settings.sandbox_addr),
            "environment_addr": _bound_port(settings.environment_addr),
            "session_addr": _bound_port(settings.session_addr),
            "gateway_port": settings.gateway_port or _free_port(),
        }
    )
    # The gateway's schema and the dev key, before the gateway starts.
    database = await open_gateway_database(settings)
    try:
        key = await ensure_dev_key(database, settings.dev_org)
    finally:
        await database.dispose()
    supervisor = Supervisor(grace_s=settings.grace_s, start_timeout_s=settings.serve_start_timeout_s)
    env = _child_env(settings, supervisor.lifeline_fd, token_made=token_made)
    children = [
        Child(name, module, ready=_grpc_ready(str(getattr(settings, f"{name}_addr"))), env=_metrics_env(settings, index))
        for index, (name, module) in enumerate(_CHILDREN)
    ]
    readyz = f"http://{settings.gateway_host}:{settings.gateway_port}/readyz"
    # The gateway serves its metrics on its own /metrics.
    children.append(Child("gateway", "gateway", ready=_http_ready(readyz), env={"BERTH_METRICS_PORT": "0"}))
    stopped = asyncio.ensure_future(wait_for_termination_signal())
    try:
        starting = asyncio.ensure_future(supervisor.start(children, env))
        await asyncio.wait([stopped, starting], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            # Stopped while starting: what started is stopped below.
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            return
        starting.result()
        _print_banner(settings, settings.gateway_port, key)
        exited = asyncio.ensure_future(supervisor.wait_for_exit())
        await asyncio.wait([stopped, exited], return_when=asyncio.FIRST_COMPLETED)
        if exited.done():
            raise ChildFailed(f"{exited.result()} exited; stopping the others")
        exited.cancel()
    except ChildFailed as exc:
        raise ServeRefused(str(exc)) from None
    finally:
        stopped.cancel()
        await supervisor.stop()


def _metrics_env(settings: Settings, index: int) -> dict[str, str]:
    """Each gRPC service serves its own metrics, on ``BERTH_METRICS_PORT`` plus its index in start order."""
    return {"BERTH_METRICS_PORT": str(settings.metrics_port + index if settings.metrics_port else 0)}


def _grpc_ready(address: str) -> Callable[[], Awaitable[bool]]:
    async def ready() -> bool:
        return await _check_grpc(address, None) == "SERVING"

    return ready


def _http_ready(url: str) -> Callable[[], Awaitable[bool]]:
    async def ready() -> bool:
        return await _check_http(url) == "SERVING"

    return ready


def _actual(address: str, port: int) -> str:
    if address.startswith("unix:"):
        return address
    host = address.rsplit(":", 1)[0]
    return f"{host}:{port}"


async def _keys(settings: Settings, args: argparse.Namespace) -> int:
    from gateway.keys import create_key, list_keys, open_gateway_database, revoke_key

    db = await open_gateway_database(settings)
    try:
        if args.keys_command == "create":
            scopes = [s for s in ",".join(args.scopes).split(",") if s] or list(ALL_SCOPES)
            record, plaintext = await create_key(db, args.org, scopes, name=args.name)
            print(json.dumps({"id": record.id, "org": args.org, "scopes": record.scopes, "key": plaintext}))
        elif args.keys_command == "list":
            for rec in await list_keys(db, args.org):
                print(
                    json.dumps(
                        {
                            "id": rec.id,
                            "org": rec.org_name,
                            "prefix": rec.prefix,
                            "scopes": rec.scopes,
                            "revoked": rec.revoked_at is not None,
                        }
                    )
                )
        elif args.keys_command == "revoke":
            rec = await revoke_key(db, args.key_id)
            print(json.dumps({"id": rec.id, "revoked": True}))
        return 0
    finally:
        await db.dispose()


def _cli_credentials(settings: Settings) -> PeerCredentials | None:
    try:
        return PeerCredentials.from_settings(settings, "cli")
    except InternalTokenMissing:
        return None


async def _check_grpc(address: str, credentials: PeerCredentials | None) -> str:
    async with open_channel(address, timeout_s=2.0, credentials=credentials) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
        except grpc.aio.AioRpcError as exc:
            return f"unreachable ({exc.code().name})"
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))


async def _check_http(url: str) -> str:
    import httpx

    try:
        async with httpx.AsyncClient(timeout=2.0) as client:
            resp = await client.get(url)
    except httpx.HTTPError as exc:
        return f"unreachable ({type(exc).__name__})"
    return "SERVING" if resp.status_code == 200 else f"NOT_SERVING (HTTP {resp.status_code})"


async def _status(settings: Settings) -> int:
    settings = _client_settings(settings)
    # Health checks need no token; the credentials are for what status may ask later.
    credentials = _cli_credentials(settings)
    rows: list[tuple[str, str, str]] = [
        ("gateway", f"{settings.gateway_host}:{settings.gateway_port}", await _check_http(f"http://{settings.gateway_host}:{settings.gateway_port}/readyz")),
        ("session", settings.session_addr, await _check_grpc(settings.session_addr, credentials)),
        ("environment", settings.environment_addr, await _check_grpc(settings.environment_addr, credentials)),
    ]
    for node, address in settings.sandbox_nodes().items():
        label = "sandbox" if node in ("", address) else f"sandbox {node}"
        rows.append((label, address, await _check_grpc(address, credentials)))
    width = max(len(r[1]) for r in rows)
    for name, addr, state in rows:
        print(f"{name:<12} {addr:<{width}}  {state}")
    isolated = True
    if settings.sandbox_isolation == "none" and settings.sandbox_backend == "local":
        print("WARNING: sandbox isolation is 'none' (BERTH_SANDBOX_ISOLATION): sandboxes run unconfined.")
    elif _local_isolation(settings):
        from services.sandbox.isolation.preflight import check_local_host

        print("isolation (local sandboxes on this host):")
        for check in await asyncio.to_thread(check_local_host):
            print(f"  {check.piece:<18} {'on' if check.ok else 'MISSING'}: {check.detail}")
            isolated = isolated and check.ok
    return 0 if isolated and all(r[2] == "SERVING" for r in rows) else 1


async def _org_id(settings: Settings, org: str) -> str | None:
    """An organization ID as given, or the ID of the organization with this
    name in the gateway's database."""
    from gateway.keys import list_keys, open_gateway_database
    from services.core.ids import has_prefix

    if has_prefix(org, "org"):
        return org
    db = await open_gateway_database(settings)
    try:
        records = await list_keys(db, org)
    finally:
        await db.dispose()
    return records[0].org_id if records else None


async def _mcp(settings: Settings, args: argparse.Namespace) -> int:
    from berth.environment.v1 import environment_pb2, environment_service_pb2, environment_service_pb2_grpc
    from services.core.context import ORG_METADATA_KEY

    states = {environment_pb2.MCP_SERVER_STATE_RUNNING: "running", environment_pb2.MCP_SERVER_STATE_DEAD: "dead"}
    transports = {environment_pb2.MCP_TRANSPORT_TYPE_STDIO: "stdio", environment_pb2.MCP_TRANSPORT_TYPE_HTTP: "http"}

    settings = _client_settings(settings)
    try:
        credentials = PeerCredentials.from_settings(settings, "cli")
    except InternalTokenMissing as exc:
        print(f"berth: {exc}", file=sys.stderr)
        return 1
    org_id = await _org_id(settings, args.org)
    if org_id is None:
        print(f"berth: no organization named {args.org!r}", file=sys.stderr)
        return 1
    async with open_channel(settings.environment_addr, timeout_s=settings.rpc_timeout_s, credentials=credentials) as channel:
        stub = environment_service_pb2_grpc.EnvironmentServiceStub(channel)
        try:
            response = await stub.ListMcpServers(
                environment_service_pb2.ListMcpServersRequest(environment_id=args.environment),
                metadata=((ORG_METADATA_KEY, org_id),),
                timeout=settings.rpc_timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            print(f"berth: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    rows = [("LABEL", "ORIGIN", "TRANSPORT", "OWNER SESSION", "STATE")]
    for server in response.servers:
        rows.append(
            (
                server.label,
                server.origin,
                transports.get(server.transport_type, "-"),
                server.owner_session_id or "-",
                states.get(server.state, "unknown"),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="berth", description="Berth: a self-hostable Agents API runtime.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run all four services, each in a process of its own (embedded default)")
    keys = sub.add_parser("keys", help="manage organization API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="create an API key (shown once)")
    create.add_argument("--org", required=True)
    create.add_argument("--scopes", nargs="*", default=[], help="e.g. tasks:read tasks:write (default both)")
    create.add_argument("--name", default=None)
    lst = keys_sub.add_parser("list", help="list keys (never their secrets)")
    lst.add_argument("--org", default=None)
    revoke = keys_sub.add_parser("revoke", help="revoke a key; it fails immediately")
    revoke.add_argument("key_id")
    sub.add_parser("status", help="print the health of each service")
    mcp = sub.add_parser("mcp", help="inspect environment-origin MCP servers")
    mcp_sub = mcp.add_subparsers(dest="mcp_command", required=True)
    mcp_list = mcp_sub.add_parser("list", help="list an environment's MCP servers: label, origin, owner session, state")
    mcp_list.add_argument("--org", required=True, help="organization name or ID")
    mcp_list.add_argument("--environment", required=True, help="environment ID")
    token = sub.add_parser("token", help="internal token of a deployment's services")
    token_sub = token.add_subparsers(dest="token_command", required=True)
    token_sub.add_parser("create", help="print a new random secret for BERTH_INTERNAL_TOKEN")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "token":
        print(secrets.token_urlsafe(32))
        return 0
    settings = Settings()
    if args.command == "serve":
        configure_logging(settings.log_level, json=settings.log_json)
        try:
            asyncio.run(_serve(settings))
        except KeyboardInterrupt:
            pass
        except ServeRefused as exc:
            print(f"berth serve: {exc}", file=sys.stderr)
            return 1
        return 0
    configure_logging("WARNING", json=settings.log_json)
    if args.command == "keys":
        return asyncio.run(_keys(settings, args))
    if args.command == "status":
        return asyncio.run(_status(settings))
    if args.command == "mcp":
        return asyncio.run(_mcp(settings, args))
    return 2


if __name__ == "__main__":
    sys.exit(main())


