"""Environment service logic as plain typed async methods.

The servicer translates protos to these calls; everything here is testable
without gRPC, with a fake ``Compute``. Every method takes the caller's
organization: another organization's resources are ``NotFound``.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

import structlog
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from berth.common.v1 import common_pb2
from berth.environment.v1 import environment_pb2
from berth.sandbox.v1 import sandbox_pb2
from services.core.db import Database
from services.core.errors import (
    BerthError,
    EnvironmentFailed,
    EnvironmentInUse,
    InitializationRunning,
    InvalidArgument,
    NotFound,
    SandboxUnavailable,
)
from services.core.ids import has_prefix, new_id
from services.core.logging import get_logger
from services.core.settings import Settings
from services.environment import paging
from services.environment import repository as repo
from services.environment.compute import Compute, ExecEvent, ProcessStart, SandboxRef
from services.environment.environment_secrets import environment_secrets_problem
from services.environment.file_store import FileStore
from services.environment.vaults import VaultStore
from services.environment.init_guard import InitGuard
from services.environment.mcp_registry import McpServerInfo, merge_servers, parse_transport, transport_name, validate_label
from services.environment.models import (
    LIFETIME_PRIVATE,
    MCP_ORIGIN_ENVIRONMENT,
    ROLE_OWNER,
    ROLE_REFERENCE,
    BindingRow,
    EnvironmentRow,
    McpServerRow,
    McpServerUseRow,
    RegisteredFileRow,
)
from services.environment.setup_steps import parse_capabilities
from services.environment.states import EnvironmentStatus
from services.environment.workspace_paths import (
    OWNER_OUTPUT_DIR,
    SESSIONS_OUTPUT_DIR,
    WORKSPACE,
    session_output_dir,
    validate_session_id,
    workspace_dir_path,
    workspace_file_path,
)

__all__ = ["EnvironmentDomain", "LiveFile", "SessionOutputs", "output_env"]

log = get_logger(__name__)

# Cleanup of MCP brokers is best effort; an upstream that does not answer
# must not hold up session or environment deletion.
_MCP_CLEANUP_TIMEOUT_S = 10.0
_MAX_VAULTS = 10


@dataclass(frozen=True)
class LiveFile:
    """A live workspace file with its registration, if any."""

    environment_id: str
    path: str
    size_bytes: int
    id: str = ""
    source: str = ""
    file_id: str = ""


def output_env(session_id: str, output_dir: str) -> dict[str, str]:
    """The variables that tell a command where its session's deliverables go."""
    return {
        "REBYTE_OUTPUT_DIR": output_dir,
        "REBYTE_SESSION_ID": session_id,
        "BERTH_OUTPUT_DIR": output_dir,
        "BERTH_SESSION_ID": session_id,
    }


def _path_key(path: str) -> list[str]:
    # The files API sorts by case-sensitive path components.
    return path.split("/")


@contextlib.contextmanager
def _sandbox_errors(environment_id: str, session_id: str = "") -> Iterator[None]:
    """An unreachable sandbox is reported with the IDs needed for diagnosis.
    It never changes the environment: no replacement, no failure mark."""
    try:
        yield
    except SandboxUnavailable as exc:
        where = f"environment {environment_id}" + (f", session {session_id}" if session_id else "")
        ids = {"environment_id": environment_id} | ({"session_id": session_id} if session_id else {})
        raise SandboxUnavailable(f"the sandbox is unavailable ({where})", **ids) from exc


def _command_cwd(argv: Sequence[str], shell: str, cwd: str) -> str:
    """A command's checked working directory; a command is argv or shell."""
    if bool(argv) == bool(shell):
        raise InvalidArgument("exactly one of argv and shell is required", param="argv")
    return workspace_dir_path(cwd or WORKSPACE, param="cwd")


@dataclass(frozen=True)
class SessionOutputs:
    """A session's output directory, the regular files in it to publish,
    and the environment as read with the session's binding (None unless it
    was ready then)."""

    output_dir: str
    entries: list[common_pb2.FileEntry]
    environment: EnvironmentRow | None


def _sandbox(row: EnvironmentRow) -> SandboxRef:
    """The environment's sandbox on the node its row records."""
    return SandboxRef(row.sandbox_id, row.sandbox_node)


def _require_env_id(environment_id: str) -> None:
    if not has_prefix(environment_id, "env"):
        raise NotFound(f"environment {environment_id} not found")


def _require_binding(binding: BindingRow | None, org_id: str, environment_id: str, session_id: str) -> BindingRow:
    if binding is None or binding.org_id != org_id:
        raise NotFound(f"session {session_id} is not attached to environment {environment_id}")
    return binding


def _not_found(environment_id: str) -> NotFound:
    return NotFound(f"environment {environment_id} not found")


class EnvironmentDomain:
    def __init__(
        self,
        db: Database,
        guard: InitGuard,
        compute: Compute,
        file_store: FileStore,
        settings: Settings,
        *,
        vaults: VaultStore,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self._db = db
        self._vaults = vaults
        # Called after environments are created or deleted (metrics).
        self._on_change = on_change or (lambda: None)
        self._guard = guard
        self._compute = compute
        self._files = file_store
        self._settings = settings
        # (environment_id, session_id) whose output directory exists already.
        self._output_dirs: set[tuple[str, str]] = set()
        # (environment_id, label, session_id) uses recorded already.
        self._mcp_uses: set[tuple[str, str, str]] = set()

    # Environments -------------------------------------------------------------

    async def create_environment(
        self, org_id: str, config: environment_pb2.EnvironmentConfig, vault_ids: Sequence[str], owner_session_id: str
    ) -> tuple[EnvironmentRow, BindingRow | None]:
        config = await self.validated_config(org_id, config)
        if len(vault_ids) > _MAX_VAULTS or any(not v for v in vault_ids):
            raise InvalidArgument(f"vault_ids takes up to {_MAX_VAULTS} non-empty IDs", param="vault_ids")
        await self._vaults.check_vaults(org_id, vault_ids)
        await self._check_environment_secrets(org_id, config, vault_ids)
        if owner_session_id:
            validate_session_id(owner_session_id, param="owner_session_id")
        now = time.time()
        row = EnvironmentRow(
            id=new_id("env"),
            org_id=org_id,
            status=EnvironmentStatus.PENDING,
            lifetime=LIFETIME_PRIVATE,
            ever_shared=False,
            deleting=False,
            sandbox_id=new_id("sbx"),
            sandbox_requested=False,
            sandbox_node="",
            config=config.SerializeToString(),
            vault_ids_json=json.dumps(list(vault_ids)),
            owner_session_id=owner_session_id,
            session_count=1 if owner_session_id else 0,
            error_code="",
            error_message="",
            init_version=0,
            lease_owner="",
            lease_expires_at=0.0,
            create_time=now,
            update_time=now,
        )
        binding = None
        if owner_session_id:
            binding = BindingRow(
                environment_id=row.id,
                session_id=owner_session_id,
                org_id=org_id,
                role=ROLE_OWNER,
                output_dir=OWNER_OUTPUT_DIR,
                create_time=now,
            )
        async def insert(s: AsyncSession) -> None:
            s.add(row)
            if binding is not None:
                s.add(binding)

        await self._db.run(insert)
        self._on_change()
        structlog.contextvars.bind_contextvars(environment_id=row.id)
        log.info("environment_created", owner_session_id=owner_session_id or None)
        return row, binding

    async def _check_environment_secrets(
        self, org_id: str, config: environment_pb2.EnvironmentConfig, vault_ids: Sequence[str]
    ) -> None:
        """environment_variable credentials are substituted by the egress
        proxy, which only a ``restricted`` network has; any other network
        would leave the placeholder useless or, worse, invite a weaker path.
        The setup checks the same again (a credential can be added later)."""
        credentials = await self._vaults.environment_variable_credentials(org_id, vault_ids)
        if not credentials:
            return
        problem = environment_secrets_problem(config.network, [auth for _, auth in credentials])
        if problem:
            raise InvalidArgument(problem, param="vault_ids")
        names = [auth.secret_name for _, auth in credentials]
        if len(set(names)) != len(names):
            raise InvalidArgument("two environment_variable credentials set the same secret_name", param="vault_ids")

    async def validated_config(
        self, org_id: str, config: environment_pb2.EnvironmentConfig
    ) -> environment_pb2.EnvironmentConfig:
        """The service's invariants on a configuration; its shape (enums,
        network policy, required fields) is the gateway's to check. Nothing is
        written outside the workspace, referenced files exist, sizes stay
        within limits, variables are valid process environment names, and
        skill and plugin archives unpack."""
        config = environment_pb2.EnvironmentConfig.FromString(config.SerializeToString())
        for i, f in enumerate(config.files):
            workspace_file_path(f.path, param=f"environment.files[{i}].path")
            source = f.WhichOneof("source")
            if source is None:
                raise InvalidArgument("a file needs data or file_id", param=f"environment.files[{i}]")
            if source == "file_id":
                try:
                    stored = await self._files.get(org_id, f.file_id)
                except NotFound:
                    # Another organization's file reads like a missing one, as in a path.
                    raise NotFound(f"file {f.file_id} not found", param=f"environment.files[{i}].file_id") from None
                f.size_bytes = stored.size_bytes
            elif len(f.data) > self._settings.max_body_bytes:
                raise InvalidArgument("inline file is too large", param=f"environment.files[{i}].data")
            else:
                f.size_bytes = len(f.data)
            if not f.id:
                f.id = new_id("file")
        for key in config.env:
            if not key or "=" in key or "\x00" in key:
                raise InvalidArgument(f"invalid environment variable name {key!r}", param="environment.env")
        for i, cmd in enumerate(config.setup_commands):
            if cmd.cwd:
                workspace_dir_path(cmd.cwd, param=f"environment.setup_commands[{i}].cwd")
        for i, directory in enumerate(config.capability_directories):
            if not directory.startswith("/") or "\x00" in directory:
                raise InvalidArgument("must be an absolute path", param=f"environment.capability_directories[{i}]")
        for kind, raw in (("skill", config.skills_json), ("plugin", config.plugins_json)):
            try:
                parse_capabilities(raw, kind=kind, max_bytes=self._settings.max_body_bytes * 4)
            except ValueError as exc:
                index = exc.args[1] if len(exc.args) > 1 else None
                param = f"environment.{kind}s" + (f"[{index}]" if index is not None else "")
                raise InvalidArgument(str(exc.args[0]), param=param) from None
        return config

    async def get_environment(self, org_id: str, environment_id: str, *, with_config: bool = True) -> EnvironmentRow:
        _require_env_id(environment_id)
        async with self._db.transaction(read_only=True) as s:
            row = await repo.get_environment(s, environment_id, org_id, with_config=with_config)
        if row is None:
            raise _not_found(environment_id)
        return row

    async def list_environments(
        self, org_id: str, *, page_size: int, after: str, order: str
    ) -> tuple[Sequence[EnvironmentRow], bool]:
        limit = paging.page_size(page_size)
        ascending = paging.page_order(order) == "asc"
        async with self._db.transaction(read_only=True) as s:
            rows = await repo.list_environments(s, org_id, after=after, ascending=ascending, limit=limit + 1)
        return rows[:limit], len(rows) > limit

    async def delete_environment(self, org_id: str, environment_id: str) -> None:
        _require_env_id(environment_id)
        async def mark(s: AsyncSession) -> tuple[bool, EnvironmentRow | None]:
            marked = await repo.mark_deleting(s, environment_id, org_id, require_unbound=True, require_never_shared=False)
            if marked:
                return True, await repo.get_environment_by_id(s, environment_id)
            return False, await repo.get_environment(s, environment_id, org_id)

        marked, row = await self._db.run(mark)
        if row is None:
            raise _not_found(environment_id)
        if not marked:
            if row.session_count > 0:
                raise EnvironmentInUse(f"environment {environment_id} has attached sessions", environment_id=environment_id)
            if row.status == EnvironmentStatus.INITIALIZING:
                raise InitializationRunning(f"environment {environment_id} is initializing", environment_id=environment_id)
            raise _not_found(environment_id)
        await self._teardown(row)
        log.info("environment_deleted", environment_id=environment_id)

    async def _teardown(self, row: EnvironmentRow, session_id: str = "") -> None:
        """Destroys the sandbox (if one was ever requested) and removes the
        rows of an environment already marked as deleting."""
        if row.sandbox_requested:
            await self._stop_mcp_brokers(row)
            try:
                with _sandbox_errors(row.id, session_id):
                    await self._compute.destroy_sandbox(_sandbox(row))
            except BaseException:
                await self._db.run(lambda s: repo.clear_deleting(s, row.id))
                raise
        await self._db.run(lambda s: repo.delete_environment_rows(s, row.id))
        self._on_change()
        self._output_dirs = {k for k in self._output_dirs if k[0] != row.id}
        self._mcp_uses = {k for k in self._mcp_uses if k[0] != row.id}

    # Bindings -----------------------------------------------------------------

    async def attach_session(self, org_id: str, environment_id: str, session_id: str) -> tuple[EnvironmentRow, BindingRow]:
        validate_session_id(session_id)
        _require_env_id(environment_id)

        async def attach(s: AsyncSession) -> BindingRow:
            if await repo.get_environment(s, environment_id, org_id) is None:
                raise _not_found(environment_id)
            binding = await repo.get_binding(s, environment_id, session_id)
            if binding is not None:
                return binding
            now = time.time()
            if not await repo.attach_reference(s, environment_id, org_id, now=now):
                current = await repo.get_environment(s, environment_id, org_id)
                if current is not None and current.status == EnvironmentStatus.INITIALIZING:
                    raise InitializationRunning(
                        f"environment {environment_id} is initializing; attach after setup ends",
                        environment_id=environment_id,
                    )
                raise _not_found(environment_id)
            binding = BindingRow(
                environment_id=environment_id,
                session_id=session_id,
                org_id=org_id,
                role=ROLE_REFERENCE,
                output_dir=session_output_dir(session_id),
                create_time=now,
            )
            s.add(binding)
            log.info("session_attached", environment_id=environment_id, session_id=session_id)
            return binding

        try:
            binding = await self._db.run(attach)
        except IntegrityError:
            # The same session attached concurrently: attaching is idempotent.
            found = await self._db.run(lambda s: repo.get_binding(s, environment_id, session_id), read_only=True)
            if found is None:
                raise
            binding = found
        return await self.get_environment(org_id, environment_id), binding

    async def get_binding(self, org_id: str, environment_id: str, session_id: str) -> BindingRow:
        _require_env_id(environment_id)
        async with self._db.transaction(read_only=True) as s:
            binding = await repo.get_binding(s, environment_id, session_id)
        return _require_binding(binding, org_id, environment_id, session_id)

    async def _binding_and_environment(
        self, org_id: str, environment_id: str, session_id: str, *, with_config: bool = False
    ) -> tuple[BindingRow, EnvironmentRow | None]:
        """The session's binding and the environment (without its
        configuration unless asked), read together: the hot path of every
        command."""
        _require_env_id(environment_id)
        async with self._db.transaction(read_only=True) as s:
            binding = await repo.get_binding(s, environment_id, session_id)
            row = await repo.get_environment(s, environment_id, org_id, with_config=with_config) if binding is not None else None
        return _require_binding(binding, org_id, environment_id, session_id), row

    async def detach_session(self, org_id: str, environment_id: str, session_id: str) -> bool:
        """Removes the binding; returns True when the private environment was
        deleted with it. Detaching a session that is not bound is a no-op."""
        _require_env_id(environment_id)
        deadline = time.monotonic() + self._settings.setup_timeout_s
        while True:
            step = await self._db.run(lambda s: _detach_step(s, org_id, environment_id, session_id))
            if step is None:
                return False
            row, http_labels, doomed = step
            if http_labels is not None:
                self._output_dirs.discard((environment_id, session_id))
                self._mcp_uses = {k for k in self._mcp_uses if k[0] != environment_id or k[2] != session_id}
                log.info("session_detached", environment_id=environment_id, session_id=session_id)
                await self._close_mcp_upstreams(row, session_id, http_labels)
                return False
            if doomed is not None:
                await self._teardown(doomed, session_id)
                log.info("environment_deleted", environment_id=environment_id, reason="owner_detached")
                return True
            if row.status == EnvironmentStatus.INITIALIZING:
                # Setup of a private environment ends before it is deleted.
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise InitializationRunning(
                        f"environment {environment_id} is initializing", environment_id=environment_id
                    )
                await self._guard.wait_settled(environment_id, org_id, timeout_s=remaining)

    # The init guard and sandbox operations ------------------------------------

    async def ensure_ready(self, org_id: str, environment_id: str) -> EnvironmentRow:
        _require_env_id(environment_id)
        with _sandbox_errors(environment_id):
            row = await self._guard.ensure_ready(environment_id, org_id)
        return await self.get_environment(org_id, row.id)

    async def _ready(self, org_id: str, environment_id: str, session_id: str = "") -> EnvironmentRow:
        _require_env_id(environment_id)
        with _sandbox_errors(environment_id, session_id):
            row = await self._guard.ensure_ready(environment_id, org_id)
        if row.status == EnvironmentStatus.FAILED:
            raise EnvironmentFailed(
                f"environment {environment_id} failed to initialize: {row.error_message}",
                environment_id=environment_id,
                error_code=row.error_code,
            )
        return row

    async def exec_command(
        self,
        org_id: str,
        environment_id: str,
        *,
        session_id: str,
        argv: Sequence[str],
        shell: str,
        cwd: str,
        env: Mapping[str, str],
        timeout_ms: int,
    ) -> AsyncIterator[ExecEvent]:
        cwd = _command_cwd(argv, shell, cwd)
        if timeout_ms < 0:
            raise InvalidArgument("timeout_ms must not be negative", param="timeout_ms")
        row, command_env = await self._command_site(org_id, environment_id, session_id, env)
        with _sandbox_errors(environment_id, session_id):
            async for event in self._compute.exec(
                _sandbox(row), argv=argv, shell=shell, cwd=cwd, env=command_env, timeout_ms=timeout_ms
            ):
                yield event

    async def _command_site(
        self, org_id: str, environment_id: str, session_id: str, env: Mapping[str, str]
    ) -> tuple[EnvironmentRow, dict[str, str]]:
        """Where a command of a session runs: the ready environment and the
        variables with the session's output directory, which exists once
        this returns."""
        command_env = dict(env)
        binding = None
        row: EnvironmentRow | None = None
        if session_id:
            binding, row = await self._binding_and_environment(org_id, environment_id, session_id)
            # Config variables were given to the sandbox at creation; these win over them.
            command_env.update(output_env(session_id, binding.output_dir))
        if row is None or row.status != EnvironmentStatus.READY:
            # Not known to be ready: through the init guard (which may start setup).
            row = await self._ready(org_id, environment_id, session_id)
        if binding is not None:
            with _sandbox_errors(environment_id, session_id):
                await self._ensure_output_dir(row, binding)
        return row, command_env

    async def start_process(self, org_id: str, environment_id: str, *, session_id: str, start: ProcessStart) -> sandbox_pb2.Process:
        row, start = await self._process_site(org_id, environment_id, session_id, start)
        with _sandbox_errors(environment_id, session_id):
            return await self._compute.start_process(_sandbox(row), start)

    async def run_process(
        self, org_id: str, environment_id: str, *, session_id: str, start: ProcessStart
    ) -> AsyncIterator[sandbox_pb2.Process | ExecEvent]:
        """``start_process`` then ``attach_process`` from the first chunk: the
        Process first, then its events, through one init guard entry and one
        sandbox call."""
        row, start = await self._process_site(org_id, environment_id, session_id, start)
        with _sandbox_errors(environment_id, session_id):
            async for event in self._compute.run_process(_sandbox(row), start):
                yield event

    async def _process_site(
        self, org_id: str, environment_id: str, session_id: str, start: ProcessStart
    ) -> tuple[EnvironmentRow, ProcessStart]:
        """The environment a process starts in, and ``start`` as it runs
        there: in its working directory, with the environment's variables."""
        cwd = _command_cwd(start.argv, start.shell, start.cwd)
        row, command_env = await self._command_site(org_id, environment_id, session_id, start.env)
        return row, replace(start, cwd=cwd, env=command_env)

    async def attach_process(
        self, org_id: str, environment_id: str, process_id: str, *, from_seq: int
    ) -> AsyncIterator[ExecEvent]:
        row = await self._ready(org_id, environment_id)
        with _sandbox_errors(environment_id):
            async for event in self._compute.attach_process(_sandbox(row), process_id, from_seq=from_seq):
                yield event

    async def kill_process(
        self, org_id: str, environment_id: str, process_id: str, *, signal: int
    ) -> sandbox_pb2.Process | None:
        row = await self._ready(org_id, environment_id)
        with _sandbox_errors(environment_id):
            return await self._compute.kill_process(_sandbox(row), process_id, signal=signal)

    async def write_process_stdin(
        self, org_id: str, environment_id: str, process_id: str, data: bytes, *, close: bool
    ) -> sandbox_pb2.Process:
        if len(data) > self._settings.max_body_bytes:
            raise InvalidArgument("stdin data is too large", param="data")
        row = await self._ready(org_id, environment_id)
        with _sandbox_errors(environment_id):
            return await self._compute.write_process_stdin(_sandbox(row), process_id, data, close=close)

    async def list_processes(self, org_id: str, environment_id: str) -> list[sandbox_pb2.Process]:
        row = await self._ready(org_id, environment_id)
        with _sandbox_errors(environment_id):
            return await self._compute.list_processes(_sandbox(row))

    async def _ensure_output_dir(self, row: EnvironmentRow, binding: BindingRow) -> None:
        key = (row.id, binding.session_id)
        if key in self._output_dirs:
            return
        try:
            # By sandboxd itself: no process, and no need for a mkdir in the image.
            await self._compute.make_directory(_sandbox(row), binding.output_dir)
        except SandboxUnavailable:
            raise
        except BerthError as exc:
            # The command still runs; it finds no output directory.
            log.warning("output_dir_create_failed", environment_id=row.id, session_id=binding.session_id, error=exc.message)
            return
        self._output_dirs.add(key)

    async def read_workspace_file(self, org_id: str, environment_id: str, path: str) -> AsyncIterator[tuple[bytes, int]]:
        path = workspace_file_path(path)
        row = await self._ready(org_id, environment_id)
        with _sandbox_errors(environment_id):
            async for chunk in self._compute.read_file(_sandbox(row), path):
                yield chunk

    async def write_workspace_file(self, org_id: str, environment_id: str, path: str, data: bytes) -> common_pb2.FileEntry:
        path = workspace_file_path(path)
        if len(data) > self._settings.max_body_bytes:
            raise InvalidArgument("file is too large", param="data")
        row = await self._ready(org_id, environment_id)
        with _sandbox_errors(environment_id):
            return await self._compute.write_file(_sandbox(row), path, data)

    async def remove_workspace_file(self, org_id: str, environment_id: str, path: str) -> None:
        path = workspace_file_path(path)
        row = await self._ready(org_id, environment_id)
        with _sandbox_errors(environment_id):
            await self._compute.remove_file(_sandbox(row), path)

    async def list_workspace_files(
        self, org_id: str, environment_id: str, path: str, *, recursive: bool
    ) -> list[common_pb2.FileEntry]:
        path = workspace_dir_path(path)
        row = await self._ready(org_id, environment_id)
        with _sandbox_errors(environment_id):
            return await self._compute.list_files(_sandbox(row), path, recursive=recursive)

    async def _list_or_empty(self, row: EnvironmentRow, path: str, session_id: str = "") -> list[common_pb2.FileEntry]:
        try:
            with _sandbox_errors(row.id, session_id):
                return await self._compute.list_files(_sandbox(row), path, recursive=True)
        except NotFound:
            return []

    async def list_session_outputs(self, org_id: str, environment_id: str, session_id: str) -> SessionOutputs:
        binding, found = await self._binding_and_environment(org_id, environment_id, session_id, with_config=True)
        if found is None:
            raise _not_found(environment_id)
        row = found
        if row.status == EnvironmentStatus.INITIALIZING:
            row = await self._guard.wait_settled(environment_id, org_id, timeout_s=self._settings.setup_timeout_s)
        if row.status != EnvironmentStatus.READY:
            # Never initialized (or failed before anything could run): nothing to publish.
            return SessionOutputs(binding.output_dir, [], None)
        entries = [
            e
            for e in await self._list_or_empty(row, binding.output_dir, session_id)
            if e.type == common_pb2.FILE_TYPE_FILE
            and e.path.startswith(binding.output_dir + "/")
            # Only referencing sessions write under sessions/; the owner never publishes it.
            and not (binding.role == ROLE_OWNER and e.path.startswith(SESSIONS_OUTPUT_DIR + "/"))
        ]
        entries.sort(key=lambda e: e.path)
        # The row read with the binding, when it was ready then: it has its configuration.
        return SessionOutputs(binding.output_dir, entries, found if row is found else None)

    # Environment-origin MCP servers -------------------------------------------

    async def start_mcp_server(
        self, org_id: str, environment_id: str, session_id: str, label: str, transport_json: str, *, credential_id: str = ""
    ) -> tuple[McpServerInfo, bool]:
        """Starts the label's broker with this configuration, or joins the
        one already there. The sandbox decides who was first (its broker
        start is atomic per label); the registry records the session whose
        start created the broker as the owner. A joiner's configuration is
        never compared or applied, and a dead broker stays dead."""
        validate_label(label)
        transport = parse_transport(transport_json)
        if session_id:
            await self.get_binding(org_id, environment_id, session_id)
        row = await self._ready(org_id, environment_id, session_id)
        if transport.HasField("http"):
            await self._inject_vault_credential(org_id, row, transport.http, credential_id)
        with _sandbox_errors(environment_id, session_id):
            broker, created = await self._compute.start_mcp_broker(_sandbox(row), label, transport)
        now = time.time()
        entry = McpServerRow(
            environment_id=environment_id,
            label=label,
            org_id=org_id,
            origin=MCP_ORIGIN_ENVIRONMENT,
            transport_type=transport_name(broker.transport_type),
            owner_session_id=session_id if created else "",
            create_time=now,
        )
        async def register(s: AsyncSession) -> tuple[list[McpServerRow], list[McpServerUseRow]]:
            if created:
                await repo.claim_mcp_server(s, entry)
            else:
                await repo.register_mcp_server(s, entry)
            if session_id:
                await repo.record_mcp_use(s, environment_id, label, session_id, now=now)
            rows = [r for r in await repo.list_mcp_servers(s, environment_id) if r.label == label]
            uses = [u for u in await repo.list_mcp_uses(s, environment_id) if u.label == label]
            return rows, uses

        rows, uses = await self._db.run(register)
        if session_id:
            self._mcp_uses.add((environment_id, label, session_id))
        log.info(
            "mcp_server_started" if created else "mcp_server_joined",
            environment_id=environment_id,
            session_id=session_id or None,
            label=label,
            state=broker.state,
        )
        return merge_servers(environment_id, rows, uses, [broker])[0], created

    async def _inject_vault_credential(
        self, org_id: str, row: EnvironmentRow, http: sandbox_pb2.McpHttpTransport, credential_id: str
    ) -> None:
        """Puts the credential of the environment's own vaults for this URL in
        the broker's headers. The broker's HTTP client runs in the Sandbox
        service, so the value never enters the sandbox."""
        authorization, _ = await self._vaults.resolve_mcp(
            org_id, json.loads(row.vault_ids_json), credential_id=credential_id, server_url=http.server_url
        )
        if authorization and urlsplit(http.server_url).scheme != "https":
            # Plain HTTP from the sandbox's network could be read or answered
            # by code in the sandbox (its own loopback included).
            raise InvalidArgument(
                "vault credentials reach environment-origin MCP servers over https only", param="credential_id"
            )
        if authorization:
            for key in [k for k in http.headers if k.lower() == "authorization"]:
                del http.headers[key]
            http.headers["Authorization"] = authorization

    async def send_mcp_message(
        self, org_id: str, environment_id: str, session_id: str, label: str, message_json: str, *, timeout_s: float | None
    ) -> str:
        validate_label(label)
        if session_id:
            await self.get_binding(org_id, environment_id, session_id)
        row = await self._ready(org_id, environment_id, session_id)
        with _sandbox_errors(environment_id, session_id):
            response = await self._compute.send_mcp_message(
                _sandbox(row), label, message_json, timeout_s=timeout_s or self._settings.mcp_call_timeout_s
            )
        key = (environment_id, label, session_id)
        if session_id and key not in self._mcp_uses:
            await self._db.run(lambda s: repo.record_mcp_use(s, environment_id, label, session_id, now=time.time()))
            self._mcp_uses.add(key)
        return response

    async def list_mcp_servers(self, org_id: str, environment_id: str) -> list[McpServerInfo]:
        """The registry with each broker's live state. An environment that
        is not ready has no brokers; listing never starts it."""
        row = await self.get_environment(org_id, environment_id, with_config=False)
        async with self._db.transaction(read_only=True) as s:
            rows = await repo.list_mcp_servers(s, environment_id)
            uses = await repo.list_mcp_uses(s, environment_id)
        brokers = []
        if row.status == EnvironmentStatus.READY and row.sandbox_requested:
            with _sandbox_errors(environment_id):
                brokers = await self._compute.list_mcp_brokers(_sandbox(row))
        return merge_servers(environment_id, rows, uses, brokers)

    async def _close_mcp_upstreams(self, row: EnvironmentRow, session_id: str, labels: Sequence[str]) -> None:
        """A deleted session's HTTP MCP connections are closed, including the
        upstream session its peers share on the same broker: their next
        request opens a fresh one. Stdio servers keep running. Best effort:
        the session is gone either way."""
        if not labels or row.status != EnvironmentStatus.READY:
            return
        for label in labels:
            try:
                closed = await self._compute.close_mcp_upstream(_sandbox(row), label, timeout_s=_MCP_CLEANUP_TIMEOUT_S)
            except BerthError as exc:
                log.warning(
                    "mcp_upstream_close_failed", environment_id=row.id, session_id=session_id, label=label, error=exc.message
                )
                continue
            log.info("mcp_upstream_closed", environment_id=row.id, session_id=session_id, label=label, closed=closed)

    async def _stop_mcp_brokers(self, row: EnvironmentRow) -> None:
        """Stops every broker before the sandbox goes, so no MCP server
        outlives its environment even if destroying the sandbox is slow or
        fails. Best effort: destroying the sandbox ends them anyway."""
        if row.status != EnvironmentStatus.READY:
            return
        try:
            brokers = await self._compute.list_mcp_brokers(_sandbox(row))
        except BerthError as exc:
            log.warning("mcp_broker_list_failed", environment_id=row.id, error=exc.message)
            return
        stopped = 0
        for broker in brokers:
            if broker.state == sandbox_pb2.MCP_BROKER_STATE_DEAD:
                continue
            try:
                await self._compute.stop_mcp_broker(_sandbox(row), broker.label, timeout_s=_MCP_CLEANUP_TIMEOUT_S)
                stopped += 1
            except BerthError as exc:
                log.warning("mcp_broker_stop_failed", environment_id=row.id, label=broker.label, error=exc.message)
        if brokers:
            log.info("mcp_servers_stopped", environment_id=row.id, stopped=stopped)

    # Files API ----------------------------------------------------------------

    async def create_environment_file(
        self, org_id: str, environment_id: str, path: str, *, data: bytes | None, file_id: str | None
    ) -> RegisteredFileRow:
        path = workspace_file_path(path)
        if data is None and not file_id:
            raise InvalidArgument("data or file_id is required", param="data")
        if file_id:
            try:
                content = await self._files.read(org_id, file_id)
            except NotFound:
                raise NotFound(f"file {file_id} not found", param="file_id") from None
            source = "file_id"
        else:
            content = data or b""
            source = "inline"
        if len(content) > self._settings.max_body_bytes:
            raise InvalidArgument("file is too large", param="data")
        row = await self._ready(org_id, environment_id)
        with _sandbox_errors(environment_id):
            await self._compute.write_file(_sandbox(row), path, content)
        registered = RegisteredFileRow(
            environment_id=environment_id,
            path=path,
            id=new_id("file"),
            source=source,
            file_id=file_id or "",
            size_bytes=len(content),
            create_time=time.time(),
        )
        return await self._db.run(lambda s: repo.upsert_registered_file(s, registered))

    async def list_environment_files(
        self, org_id: str, environment_id: str, *, path: str, order: str, page_size: int, page_token: str
    ) -> tuple[list[LiveFile], str]:
        directory = workspace_dir_path(path)
        order = paging.page_order(order)
        limit = paging.page_size(page_size)
        after = _decode_token(page_token, directory=directory, order=order) if page_token else None
        row = await self._ready(org_id, environment_id)
        entries = [e for e in await self._list_or_empty(row, directory) if e.type == common_pb2.FILE_TYPE_FILE]
        descending = order == "desc"
        entries.sort(key=lambda e: _path_key(e.path), reverse=descending)
        if after is not None:
            cursor = _path_key(after)
            entries = [e for e in entries if (_path_key(e.path) < cursor if descending else _path_key(e.path) > cursor)]
        page = entries[:limit]
        async with self._db.transaction(read_only=True) as s:
            registered = await repo.registered_files_by_path(s, environment_id)
        files = []
        for e in page:
            reg = registered.get(e.path)
            files.append(
                LiveFile(
                    environment_id=environment_id,
                    path=e.path,
                    size_bytes=e.size_bytes,
                    id=reg.id if reg else "",
                    source=reg.source if reg else "",
                    file_id=reg.file_id if reg else "",
                )
            )
        next_token = _encode_token(directory, order, page[-1].path) if len(entries) > limit else ""
        return files, next_token


async def _detach_step(
    s: AsyncSession, org_id: str, environment_id: str, session_id: str
) -> tuple[EnvironmentRow, list[str] | None, EnvironmentRow | None] | None:
    """One attempt of ``detach_session`` as a unit of work: None when the
    session is not bound; else the environment, the HTTP MCP labels the
    session used (when only its binding went), and the environment marked
    for deletion (when the session was its private owner and it could be)."""
    row = await repo.get_environment(s, environment_id, org_id)
    if row is None:
        raise _not_found(environment_id)
    binding = await repo.get_binding(s, environment_id, session_id)
    if binding is None:
        return None
    private_owner = binding.role == ROLE_OWNER and row.lifetime == LIFETIME_PRIVATE and not row.ever_shared
    if not private_owner:
        await repo.remove_binding(s, environment_id, session_id, now=time.time())
        http_labels = await repo.mcp_labels_used_by(s, environment_id, session_id, transport_type="http")
        await repo.remove_mcp_uses(s, environment_id, session_id)
        return row, http_labels, None
    marked = await repo.mark_deleting(s, environment_id, org_id, require_unbound=False, require_never_shared=True)
    return row, None, (await repo.get_environment_by_id(s, environment_id) if marked else None)


def _encode_token(directory: str, order: str, last_path: str) -> str:
    raw = json.dumps({"d": directory, "o": order, "a": last_path}, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _decode_token(token: str, *, directory: str, order: str) -> str:
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        value = json.loads(raw)
        after = value["a"]
        ok = isinstance(after, str) and value["d"] == directory and value["o"] == order
    except (binascii.Error, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise InvalidArgument("invalid page token; keep the same path and order", param="page")
    return str(after)
