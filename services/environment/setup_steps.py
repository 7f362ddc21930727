"""The setup steps an init-once operation runs in a new sandbox, recorded
as a journal.

Order: the sandbox (place it on a Sandbox service node, record that node on
the environment's row, create it there), each configured file, each package
set, each setup command, then skills and plugins. Each step is recorded as
done in ``setup_steps`` once it ended, fenced by the owner's lease, so an
owner that took the setup over (after the first one stopped) skips what is
recorded and continues from the first step that is not. The step that was
running when the first owner stopped runs again: each step runs at least
once, and a step that ran to its end and was recorded never runs again.

A takeover keeps the recorded sandbox while it is alive. A recorded sandbox
that is gone or broken is destroyed, and setup starts over in a new one.

Only a step that fails fails setup (``SetupFailed``). An unreachable Sandbox
service at any step defers setup (``SetupUnavailable``): the environment
goes back to pending with its journal, and the next caller resumes it.
Error messages never contain a setup command body: setup commands are
confidential.
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import json
import posixpath
import re
import time
import zipfile
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncSession

from berth.common.v1 import common_pb2
from berth.environment.v1 import environment_pb2, vault_pb2
from berth.sandbox.v1 import sandbox_pb2
from services.core.db import Database
from services.core.errors import BerthError, NotFound, SandboxUnavailable
from services.core.ids import new_id
from services.core.logging import get_logger
from services.core.settings import Settings
from services.environment import repository as repo
from services.environment.compute import ENVIRONMENT_LABEL, Compute, SandboxRef, SandboxSpec
from services.environment.environment_secrets import environment_secrets_problem, secret_substitutions
from services.environment.file_store import FileStore
from services.environment.init_guard import SetupFailed, SetupFence, SetupUnavailable
from services.environment.models import EnvironmentRow, RegisteredFileRow
from services.environment.vaults import VaultStore
from services.environment.workspace_paths import WORKSPACE

__all__ = ["EnvironmentSetup", "Capability", "parse_capabilities", "sandbox_env", "SKILLS_DIR", "PLUGINS_DIR", "SANDBOX_STEP"]

log = get_logger(__name__)

# The journal name of the first step.
SANDBOX_STEP = "sandbox"

SKILLS_DIR = "/workspace/.skills"
PLUGINS_DIR = "/workspace/.plugins"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class Capability:
    """One skill or plugin entry of the configuration."""

    index: int
    kind: str  # "inline" or "skill_reference"
    name: str
    archive: bytes  # ZIP bytes for inline entries


def _archive_members(archive: bytes, *, max_bytes: int) -> list[tuple[str, bytes, int]]:
    """(relative path, content, mode) of each regular file; a single common
    top-level directory is stripped. Raises ValueError on unsafe archives."""
    with zipfile.ZipFile(io.BytesIO(archive)) as zf:
        infos = [i for i in zf.infolist() if not i.is_dir()]
        total = sum(i.file_size for i in infos)
        if total > max_bytes:
            raise ValueError("archive expands beyond the size limit")
        names: list[str] = []
        for info in infos:
            name = info.filename.replace("\\", "/")
            norm = posixpath.normpath(name)
            if name.startswith("/") or norm.startswith("..") or norm in (".", ""):
                raise ValueError(f"unsafe archive member {name!r}")
            names.append(norm)
        tops = {n.split("/", 1)[0] for n in names}
        strip = len(tops) == 1 and all("/" in n for n in names)
        members: list[tuple[str, bytes, int]] = []
        for info, name in zip(infos, names, strict=True):
            rel = name.split("/", 1)[1] if strip else name
            mode = (info.external_attr >> 16) & 0o777
            members.append((rel, zf.read(info), mode))
        return members


def parse_capabilities(raw: str, *, kind: str, max_bytes: int) -> list[Capability]:
    """Parses ``skills_json`` / ``plugins_json``. Raises ValueError naming the
    offending entry index in ``args[1]``."""
    if not raw:
        return []
    try:
        items = json.loads(raw)
    except json.JSONDecodeError:
        raise ValueError(f"{kind}s must be a JSON array", None) from None
    if not isinstance(items, list):
        raise ValueError(f"{kind}s must be a JSON array", None)
    out: list[Capability] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValueError(f"{kind} {i} must be an object", i)
        typ = item.get("type")
        if typ == "skill_reference" and kind == "skill":
            if not isinstance(item.get("skill_id"), str) or not item["skill_id"]:
                raise ValueError(f"{kind} {i} needs a skill_id", i)
            out.append(Capability(i, "skill_reference", str(item["skill_id"]), b""))
            continue
        if typ != "inline":
            raise ValueError(f"{kind} {i} has an unsupported type", i)
        source = item.get("source")
        data = source.get("data") if isinstance(source, dict) else item.get("data")
        if not isinstance(data, str):
            raise ValueError(f"{kind} {i} needs base64 ZIP data", i)
        try:
            archive = base64.b64decode(data, validate=True)
            _archive_members(archive, max_bytes=max_bytes)
        except (binascii.Error, ValueError, zipfile.BadZipFile) as exc:
            raise ValueError(f"{kind} {i} is not a valid ZIP archive: {exc}", i) from None
        name = item.get("name") or f"{kind}-{i + 1}"
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"{kind} {i} has an invalid name", i)
        out.append(Capability(i, "inline", name, archive))
    return out


def sandbox_env(config: environment_pb2.EnvironmentConfig, settings: Settings) -> dict[str, str]:
    """Variables given to every command: proxy settings, then the configuration's."""
    env: dict[str, str] = {}
    for value, names in (
        (settings.sandbox_http_proxy, ("HTTP_PROXY", "http_proxy")),
        (settings.sandbox_https_proxy, ("HTTPS_PROXY", "https_proxy")),
        (settings.sandbox_no_proxy, ("NO_PROXY", "no_proxy")),
    ):
        if value:
            env.update(dict.fromkeys(names, value))
    env.update(config.env)
    return env


Step = tuple[str, Callable[[SandboxRef], Awaitable[Sequence[RegisteredFileRow]]]]


class EnvironmentSetup:
    """The ``Setup`` callable the init guard runs."""

    def __init__(
        self, compute: Compute, file_store: FileStore, db: Database, settings: Settings, *, vaults: VaultStore | None = None
    ) -> None:
        self._compute = compute
        self._files = file_store
        self._db = db
        self._settings = settings
        self._vaults = vaults

    async def __call__(self, environment: EnvironmentRow, fence: SetupFence) -> None:
        config, done = await self._db.run(lambda s: _journal(s, environment.id), read_only=True)
        if done:
            log.info("environment_setup_resumed", steps_done=len(done))
        try:
            sandbox, done = await self._sandbox(environment, fence, config, done)
            for name, run in self._steps(environment, config):
                if name in done:
                    continue
                registered = await run(sandbox)
                await fence.record_step(name, registered)
        except SandboxUnavailable:
            raise SetupUnavailable(environment.id) from None

    async def _sandbox(
        self, environment: EnvironmentRow, fence: SetupFence, config: environment_pb2.EnvironmentConfig, done: set[str]
    ) -> tuple[SandboxRef, set[str]]:
        """The step that makes the sandbox, or the recorded sandbox when it
        is alive; a recorded one that is not is destroyed and replaced, and
        the journal starts over."""
        sandbox_id = environment.sandbox_id
        if SANDBOX_STEP in done:
            recorded = SandboxRef(sandbox_id, environment.sandbox_node)
            if await self._compute.sandbox_alive(recorded):
                return recorded, done
            log.warning("environment_setup_sandbox_stale", sandbox_id=sandbox_id)
            await self._compute.destroy_sandbox(recorded)
            sandbox_id = new_id("sbx")
            await fence.replace_sandbox(sandbox_id)
            done = set()
        # A retry (the Sandbox service was unreachable, or the owner stopped)
        # keeps the node it recorded while that node answers; creating the
        # same sandbox ID again returns the sandbox made last time.
        requested = environment.sandbox_requested and sandbox_id == environment.sandbox_id
        node = await self._compute.place_sandbox(environment.sandbox_node if requested else None)
        await fence.mark_sandbox_requested(node)
        sandbox = SandboxRef(sandbox_id, node)
        spec = SandboxSpec(
            labels={ENVIRONMENT_LABEL: environment.id, "berth.org": environment.org_id},
            network=config.network,
            env=sandbox_env(config, self._settings),
            container_size=config.container_size,
            secret_substitutions=await self._secret_substitutions(environment, config),
        )
        try:
            await self._compute.create_sandbox(sandbox, spec)
        except SandboxUnavailable:
            raise
        except BerthError as exc:
            raise SetupFailed("sandbox_create_failed", f"the sandbox could not be created: {exc.message}") from exc
        await fence.record_step(SANDBOX_STEP, ())
        return sandbox, done

    async def _secret_substitutions(
        self, environment: EnvironmentRow, config: environment_pb2.EnvironmentConfig
    ) -> list[sandbox_pb2.SecretSubstitution]:
        """The environment_variable credentials of the environment's own
        vaults (never a referencing session's). One its network cannot keep
        out of the sandbox (added to a vault after the environment was
        created) fails the setup rather than create the sandbox."""
        vault_ids = json.loads(environment.vault_ids_json or "[]")
        if self._vaults is None or not vault_ids:
            return []
        try:
            secrets = await self._vaults.environment_secrets(environment.org_id, vault_ids)
        except BerthError as exc:
            raise SetupFailed("sandbox_create_failed", f"the sandbox could not be created: {exc.message}") from exc
        if not secrets:
            return []
        credentials = [
            vault_pb2.CredentialAuth(
                type="environment_variable",
                secret_name=s.secret_name,
                networking=vault_pb2.CredentialNetworking(type="unrestricted" if s.any_allowed_host else "limited"),
            )
            for s in secrets
        ]
        problem = environment_secrets_problem(config.network, credentials)
        if problem:
            raise SetupFailed("sandbox_create_failed", f"the sandbox could not be created: {problem}")
        log.info("environment_secrets_resolved", credential_ids=[s.credential_id for s in secrets])
        return secret_substitutions(secrets)

    def _steps(self, environment: EnvironmentRow, config: environment_pb2.EnvironmentConfig) -> list[Step]:
        """Every step after the sandbox, in order, each with its journal name."""
        steps: list[Step] = []
        for i, f in enumerate(config.files):
            steps.append((f"file:{i}", functools.partial(self._write_file, environment, i, f)))
        packages = config.packages
        for kind, names, argv, env in (
            ("system", packages.system, ["apt-get", "install", "-y"], {"DEBIAN_FRONTEND": "noninteractive"}),
            ("python", packages.python, ["python3", "-m", "pip", "install"], {}),
            ("npm", packages.npm, ["npm", "install", "-g"], {}),
        ):
            if names:
                steps.append((f"packages:{kind}", functools.partial(self._install_packages, kind, [*argv, *names], env)))
        for i, command in enumerate(config.setup_commands, start=1):
            steps.append((f"command:{i}", functools.partial(self._run_setup_command, i, command)))
        for kind, raw, root in (("skill", config.skills_json, SKILLS_DIR), ("plugin", config.plugins_json, PLUGINS_DIR)):
            if _has_entries(raw):
                steps.append((f"{kind}s", functools.partial(self._install_archives, raw, kind, root)))
        return steps

    async def _write_file(
        self, environment: EnvironmentRow, i: int, f: environment_pb2.InitialFile, sandbox: SandboxRef
    ) -> list[RegisteredFileRow]:
        if f.WhichOneof("source") == "file_id":
            try:
                data = await self._files.read(environment.org_id, f.file_id)
            except NotFound:
                message = f"file {i + 1} ({f.path}) refers to a stored file that no longer exists"
                raise SetupFailed("file_write_failed", message) from None
            source = "file_id"
        else:
            data = f.data
            source = "inline"
        try:
            await self._compute.write_file(sandbox, f.path, data)
        except SandboxUnavailable:
            raise
        except BerthError as exc:
            message = f"file {i + 1} ({f.path}) could not be written: {exc.message}"
            raise SetupFailed("file_write_failed", message) from exc
        return [
            RegisteredFileRow(
                environment_id=environment.id,
                path=f.path,
                id=f.id or new_id("file"),
                source=source,
                file_id=f.file_id if source == "file_id" else "",
                size_bytes=len(data),
                create_time=time.time(),
            )
        ]

    async def _exec(self, sandbox: SandboxRef, *, argv: Sequence[str] = (), shell: str = "", cwd: str = WORKSPACE,
                    env: Mapping[str, str] | None = None) -> tuple[int, bool]:
        exit_code, timed_out = -1, False
        async for event in self._compute.exec(sandbox, argv=argv, shell=shell, cwd=cwd, env=env):
            if isinstance(event, common_pb2.ExitStatus):
                exit_code, timed_out = event.exit_code, event.timed_out
        return exit_code, timed_out

    async def _install_packages(
        self, kind: str, argv: Sequence[str], env: Mapping[str, str], sandbox: SandboxRef
    ) -> Sequence[RegisteredFileRow]:
        try:
            code, timed_out = await self._exec(sandbox, argv=argv, env=env)
        except SandboxUnavailable:
            raise
        except BerthError as exc:
            message = f"{kind} package installation could not start: {exc.message}"
            raise SetupFailed("package_install_failed", message) from exc
        if code != 0 or timed_out:
            raise SetupFailed("package_install_failed", f"{kind} package installation exited with status {code}")
        return ()

    async def _run_setup_command(
        self, i: int, command: environment_pb2.SetupCommand, sandbox: SandboxRef
    ) -> Sequence[RegisteredFileRow]:
        try:
            code, timed_out = await self._exec(sandbox, shell=command.command, cwd=command.cwd or WORKSPACE)
        except SandboxUnavailable:
            raise
        except BerthError as exc:
            # The downstream message could echo the command; report its reason only.
            raise SetupFailed("setup_command_failed", f"setup command {i} could not start ({exc.reason})") from exc
        if timed_out:
            raise SetupFailed("setup_command_failed", f"setup command {i} timed out")
        if code != 0:
            raise SetupFailed("setup_command_failed", f"setup command {i} exited with status {code}")
        return ()

    async def _install_archives(self, raw: str, kind: str, root: str, sandbox: SandboxRef) -> Sequence[RegisteredFileRow]:
        limit = self._settings.max_body_bytes * 4
        try:
            capabilities = parse_capabilities(raw, kind=kind, max_bytes=limit)
        except ValueError as exc:
            raise SetupFailed(f"{kind}_install_failed", str(exc.args[0])) from None
        for cap in capabilities:
            if cap.kind != "inline":
                continue  # by-ID skills are recorded in the configuration only
            try:
                for rel, data, mode in _archive_members(cap.archive, max_bytes=limit):
                    await self._compute.write_file(sandbox, f"{root}/{cap.name}/{rel}", data, mode=mode)
            except SandboxUnavailable:
                raise
            except (BerthError, ValueError, zipfile.BadZipFile) as exc:
                message = f"{kind} {cap.index + 1} ({cap.name}) could not be installed"
                raise SetupFailed(f"{kind}_install_failed", message) from exc
        return ()


def _has_entries(raw: str) -> bool:
    """Whether a skills or plugins list gives its step anything to do: an
    empty one is no step (nor a journal write). What does not parse is left
    for its step to refuse."""
    if not raw:
        return False
    try:
        return bool(json.loads(raw) != [])
    except ValueError:
        return True


async def _journal(session: AsyncSession, environment_id: str) -> tuple[environment_pb2.EnvironmentConfig, set[str]]:
    config = environment_pb2.EnvironmentConfig.FromString(await repo.get_environment_config(session, environment_id))
    return config, await repo.done_steps(session, environment_id)
