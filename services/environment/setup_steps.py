"""The setup steps an init-once operation runs in a new sandbox.

Order: place the sandbox on a Sandbox service node and record that node on
the environment's row, create the sandbox there, write the configured files,
install packages, run setup commands, install skills and plugins. Error messages never contain a
setup command body: setup commands are confidential.

Placing, creating the sandbox and writing files are idempotent, so an
unreachable Sandbox service during those steps defers setup (``SetupUnavailable``); once
a package install or setup command may have run, it fails setup for good.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import posixpath
import re
import time
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from berth.common.v1 import common_pb2
from berth.environment.v1 import environment_pb2
from services.core.db import Database
from services.core.errors import BerthError, NotFound, SandboxUnavailable
from services.core.ids import new_id
from services.core.settings import Settings
from services.environment import repository as repo
from services.environment.compute import ENVIRONMENT_LABEL, Compute, SandboxRef, SandboxSpec
from services.environment.file_store import FileStore
from services.environment.init_guard import SetupFailed, SetupFence, SetupUnavailable
from services.environment.models import EnvironmentRow, RegisteredFileRow
from services.environment.workspace_paths import WORKSPACE

__all__ = ["EnvironmentSetup", "Capability", "parse_capabilities", "sandbox_env", "SKILLS_DIR", "PLUGINS_DIR"]

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


class EnvironmentSetup:
    """The ``Setup`` callable the init guard runs."""

    def __init__(self, compute: Compute, file_store: FileStore, db: Database, settings: Settings) -> None:
        self._compute = compute
        self._files = file_store
        self._db = db
        self._settings = settings

    async def __call__(self, environment: EnvironmentRow, fence: SetupFence) -> None:
        async with self._db.transaction() as s:
            config = environment_pb2.EnvironmentConfig.FromString(await repo.get_environment_config(s, environment.id))
        # A retry (the Sandbox service was unreachable last time) keeps the
        # node it recorded while that node answers.
        try:
            node = await self._compute.place_sandbox(environment.sandbox_node if environment.sandbox_requested else None)
        except SandboxUnavailable:
            raise SetupUnavailable(environment.id) from None
        await fence.mark_sandbox_requested(node)
        sandbox = SandboxRef(environment.sandbox_id, node)
        spec = SandboxSpec(
            labels={ENVIRONMENT_LABEL: environment.id, "berth.org": environment.org_id},
            network=config.network,
            env=sandbox_env(config, self._settings),
            container_size=config.container_size,
        )
        try:
            await self._compute.create_sandbox(sandbox, spec)
        except SandboxUnavailable:
            raise SetupUnavailable(environment.id) from None
        except BerthError as exc:
            raise SetupFailed("sandbox_create_failed", f"the sandbox could not be created: {exc.message}") from exc

        await self._write_files(environment, sandbox, config)
        try:
            await self._install_packages(sandbox, config.packages)
            await self._run_setup_commands(sandbox, config.setup_commands)
            await self._install_archives(sandbox, config.skills_json, kind="skill", root=SKILLS_DIR)
            await self._install_archives(sandbox, config.plugins_json, kind="plugin", root=PLUGINS_DIR)
        except SandboxUnavailable as exc:
            raise SetupFailed("sandbox_unavailable", "the sandbox became unavailable during setup") from exc

    async def _write_files(
        self, environment: EnvironmentRow, sandbox: SandboxRef, config: environment_pb2.EnvironmentConfig
    ) -> None:
        registered: list[RegisteredFileRow] = []
        now = time.time()
        for i, f in enumerate(config.files):
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
                raise SetupUnavailable(environment.id) from None
            except BerthError as exc:
                message = f"file {i + 1} ({f.path}) could not be written: {exc.message}"
                raise SetupFailed("file_write_failed", message) from exc
            registered.append(
                RegisteredFileRow(
                    environment_id=environment.id,
                    path=f.path,
                    id=f.id or new_id("file"),
                    source=source,
                    file_id=f.file_id if source == "file_id" else "",
                    size_bytes=len(data),
                    create_time=now,
                )
            )
        if registered:
            async with self._db.transaction() as s:
                for row in registered:
                    await repo.upsert_registered_file(s, row)

    async def _exec(self, sandbox: SandboxRef, *, argv: Sequence[str] = (), shell: str = "", cwd: str = WORKSPACE,
                    env: Mapping[str, str] | None = None) -> tuple[int, bool]:
        exit_code, timed_out = -1, False
        async for event in self._compute.exec(sandbox, argv=argv, shell=shell, cwd=cwd, env=env):
            if isinstance(event, common_pb2.ExitStatus):
                exit_code, timed_out = event.exit_code, event.timed_out
        return exit_code, timed_out

    async def _install_packages(self, sandbox: SandboxRef, packages: environment_pb2.Packages) -> None:
        steps: list[tuple[str, list[str], dict[str, str]]] = []
        if packages.system:
            steps.append(("system", ["apt-get", "install", "-y", *packages.system], {"DEBIAN_FRONTEND": "noninteractive"}))
        if packages.python:
            steps.append(("python", ["python3", "-m", "pip", "install", *packages.python], {}))
        if packages.npm:
            steps.append(("npm", ["npm", "install", "-g", *packages.npm], {}))
        for kind, argv, env in steps:
            try:
                code, timed_out = await self._exec(sandbox, argv=argv, env=env)
            except SandboxUnavailable:
                raise
            except BerthError as exc:
                message = f"{kind} package installation could not start: {exc.message}"
                raise SetupFailed("package_install_failed", message) from exc
            if code != 0 or timed_out:
                raise SetupFailed("package_install_failed", f"{kind} package installation exited with status {code}")

    async def _run_setup_commands(self, sandbox: SandboxRef, commands: Sequence[environment_pb2.SetupCommand]) -> None:
        for i, command in enumerate(commands, start=1):
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

    async def _install_archives(self, sandbox: SandboxRef, raw: str, *, kind: str, root: str) -> None:
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


