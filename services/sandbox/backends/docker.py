"""The ``docker`` backend: one container per sandbox, sandboxd as its entrypoint.

Layout of one sandbox on the host (``<data_dir>`` resolved to an absolute path)::

    <data_dir>/sandboxes/<sandbox_id>/
        workspace/        bind-mounted read-write at /workspace
        run/              bind-mounted at /run/berth: sandboxd.sock, env.json, state/
    <data_dir>/docker/
        sandboxd-<hash>.py          bind-mounted read-only at /opt/berth/sandboxd.py
        ca-bundle-<hash>.crt        bind-mounted read-only at /opt/berth/ca-certificates.crt

The workspace is a host directory rather than a named volume: the service
reads it while a sandbox is frozen, it survives the container (and the
engine) like the ``local`` backend's, and ``destroy`` deletes exactly what
``create`` made. sandboxd and the CA bundle are copied into the data dir
(named by content, so a running container's file is never replaced) because
the engine resolves bind sources on *its* host: when the Sandbox service
itself runs in a container, the data dir must be mounted at the same path
in the service container as on the engine's host, and then every bind
source above is valid for the engine. The service talks to sandboxd over the
unix socket in ``run/``; as the socket is created by root inside the
container, the service runs as root (it controls the engine anyway).

Each container carries the labels ``berth.managed=1``,
``berth.installation=<hash of the data dir>``, ``berth.sandbox_id``,
``berth.network`` and the spec's labels (``berth.org``,
``berth.environment_id``). Its name is ``berth-<installation>-<sandbox_id>``,
so several installations (and test runs) share one engine without clashing.

Reconciliation (``adopt``): containers of this installation that are running
or paused are adopted. A container whose sandbox directory is gone is an
orphan and is removed. An exited container with its directory in place is
left for inspection (``docker logs``); ``create`` of the same ID replaces it
and reuses the workspace, ``destroy`` removes it. Reaping sandboxes whose
environment no longer exists is the Environment service's decision and is
not done here.

Network policy:

* ``disabled``: ``network_mode=none``, only a loopback interface.
* ``enabled``: ``settings.docker_network``. Empty means the engine's default
  ``bridge`` network if it has one; an engine started with ``--bridge=none``
  has none, and then a user-defined bridge network ``berth-sandbox`` is used
  (created on demand). Containers on it reach each other and the host's
  non-loopback addresses; they reach the outside only if the host forwards
  and masquerades the network's subnet, which dockerd does itself unless it
  runs with ``--iptables=false`` (then ``BERTH_SANDBOX_NAT=1
  deploy/ci/setup-docker.sh`` adds the masquerade rule). ``host`` shares the host's network stack,
  including services bound to its loopback, and so is opt-in only.
* ``restricted``: no egress allowlist is enforced yet (that needs a filtering
  proxy), so it fails closed to ``disabled`` with a warning, as the ``local``
  backend does; the handle and the ``berth.network`` label record it.

Containers run the image's user (root in the Berth images) with Docker's
default capabilities minus NET_RAW, MKNOD, AUDIT_WRITE and SETFCAP, and
with ``no-new-privileges``: package installs work, raw sockets, device
nodes and setuid escalation do not. sandboxd is PID 1 and reaps orphans.

Pause and resume are ``docker pause``/``unpause`` (the cgroup freezer).
CPU and memory limits come from the spec (CPU clamped to the engine's CPU
count, which the engine requires); swap is not granted beyond the memory
limit and a PID limit stops fork bombs.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import docker
import docker.errors
import structlog
from docker.models.containers import Container
from docker.types import Mount

from services.core.settings import Settings
from services.sandbox.backends.base import (
    BackendError,
    BackendHandle,
    BackendUnavailable,
    NetworkPolicy,
    SandboxBackend,
    SandboxGone,
    SandboxSpec,
    SandboxStartError,
    proxy_env,
)
from services.sandbox.daemon_client import probe

__all__ = ["DockerBackend", "AUTO_NETWORK", "installation_id"]

log = structlog.stdlib.get_logger(__name__)

AUTO_NETWORK = "berth-sandbox"
_SANDBOX_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_DAEMON_SOURCE = Path(__file__).resolve().parent.parent / "daemon" / "sandboxd.py"
_HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
_DAEMON_IN_SANDBOX = "/opt/berth/sandboxd.py"
_CA_IN_SANDBOX = "/opt/berth/ca-certificates.crt"
_RUN_IN_SANDBOX = "/run/berth"
# Tools that do not read the system store, or read one that lacks a host
# proxy's CA, each have their own variable.
_CA_ENV = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", "PIP_CERT", "GIT_SSL_CAINFO")
_LIVE_STATES = ("running", "paused")
_PIDS_LIMIT = 4096
_POLL_S = 0.01
_INSPECT_S = 0.25
_MANAGED = "berth.managed"
_INSTALLATION = "berth.installation"
_SANDBOX_LABEL = "berth.sandbox_id"
_NETWORK_LABEL = "berth.network"

_T = TypeVar("_T")


def installation_id(data_dir: Path) -> str:
    """Identifies one data dir, hence one installation, on a shared engine."""
    return hashlib.sha256(str(Path(data_dir).resolve()).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class _Paths:
    home: Path
    workspace: Path
    run: Path

    @property
    def socket(self) -> Path:
        return self.run / "sandboxd.sock"


def _proxy_env(settings: Settings) -> dict[str, str]:
    return proxy_env(settings.sandbox_http_proxy, settings.sandbox_https_proxy, settings.sandbox_no_proxy)


_CopyKey = tuple[str, int, int, str]


def _copy_by_content(source: Path, target_dir: Path, stem: str, suffix: str, copies: dict[_CopyKey, Path]) -> Path:
    """Copies ``source`` to a read-only file named by its content hash;
    an existing copy is reused as it is (and never rewritten under a
    container that has it mounted). ``copies`` remembers the copy made for
    an unchanged source, so it is not read and hashed again."""
    stat = source.stat()
    key = (str(source), stat.st_size, stat.st_mtime_ns, str(target_dir))
    known = copies.get(key)
    if known is not None and known.exists():
        return known
    data = source.read_bytes()
    target = target_dir / f"{stem}-{hashlib.sha256(data).hexdigest()[:16]}{suffix}"
    if not target.exists():
        target_dir.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.chmod(0o444)
        tmp.replace(target)
    copies[key] = target
    return target


class DockerBackend(SandboxBackend):
    name = "docker"

    def __init__(self, settings: Settings, *, client: docker.DockerClient | None = None) -> None:
        """``client`` is for tests; by default one is made from the
        environment (``DOCKER_HOST`` etc.) on first use, so constructing the
        backend never blocks on the engine."""
        self._settings = settings
        self._data_dir = Path(settings.data_dir).resolve()
        self._image = settings.docker_image
        self._network_setting = settings.docker_network.strip()
        self._start_timeout_s = settings.docker_start_timeout_s
        self._installation = installation_id(self._data_dir)
        self._client = client
        self._client_lock = asyncio.Lock()
        self._network_lock = asyncio.Lock()
        self._enabled_network: str | None = None
        self._engine_cpus: int | None = None
        self._locks: dict[str, asyncio.Lock] = {}
        self._copies: dict[_CopyKey, Path] = {}

    # ------------------------------------------------------------ public interface

    def socket_path(self, handle: BackendHandle) -> str:
        return handle.socket_path

    async def create(self, spec: SandboxSpec) -> BackendHandle:
        if not _SANDBOX_ID.match(spec.sandbox_id):
            raise BackendError(f"invalid sandbox id {spec.sandbox_id!r}")
        async with self._lock(spec.sandbox_id):
            existing = await self._find(spec.sandbox_id)
            if existing is not None:
                if existing.status in _LIVE_STATES:
                    return self._handle_for(existing)
                # An exited container cannot be restarted into a known state;
                # a fresh one takes over its workspace.
                await self._remove_container(existing)
            return await self._start(spec)

    async def pause(self, handle: BackendHandle) -> None:
        async with self._lock(handle.sandbox_id):
            container = await self._live_container(handle)
            if container.status == "paused":
                return
            # Written files reach the disk before the processes that wrote them freeze.
            await asyncio.to_thread(os.sync)
            await self._toggle_pause(container, pause=True)

    async def resume(self, handle: BackendHandle) -> None:
        async with self._lock(handle.sandbox_id):
            container = await self._live_container(handle)
            if container.status != "paused":
                return
            await self._toggle_pause(container, pause=False)

    async def destroy(self, handle: BackendHandle) -> None:
        async with self._lock(handle.sandbox_id):
            container = await self._get(str(handle.private.get("container_id") or self._container_name(handle.sandbox_id)))
            if container is not None:
                await self._remove_container(container)
            await self._remove_tree(self._paths(handle.sandbox_id).home)
        self._locks.pop(handle.sandbox_id, None)
        log.info("sandbox_destroyed", sandbox_id=handle.sandbox_id, backend="docker")

    async def adopt(self) -> list[BackendHandle]:
        client = await self._docker()
        filters = {"label": [f"{_MANAGED}=1", f"{_INSTALLATION}={self._installation}"]}
        containers: list[Container] = await self._call(lambda: client.containers.list(all=True, filters=filters))
        handles: list[BackendHandle] = []
        for container in containers:
            sandbox_id = container.labels.get(_SANDBOX_LABEL, "")
            if not _SANDBOX_ID.match(sandbox_id):
                continue
            if not self._paths(sandbox_id).home.is_dir():
                log.warning("sandbox_orphan_removed", sandbox_id=sandbox_id, container=container.name)
                await self._remove_container(container)
                continue
            if container.status in _LIVE_STATES:
                handles.append(self._handle_for(container))
        return sorted(handles, key=lambda h: h.sandbox_id)

    async def is_alive(self, handle: BackendHandle) -> bool:
        container = await self._get(str(handle.private.get("container_id", "")))
        return container is not None and container.status in _LIVE_STATES

    def leftover_handle(self, sandbox_id: str) -> BackendHandle | None:
        if not _SANDBOX_ID.match(sandbox_id):
            return None
        paths = self._paths(sandbox_id)
        # destroy() finds the container by name and deletes the directory by ID.
        return BackendHandle(
            sandbox_id=sandbox_id,
            socket_path=str(paths.socket),
            private={"container_name": self._container_name(sandbox_id), "home": str(paths.home)},
        )

    # ------------------------------------------------------------ engine access

    async def _docker(self) -> docker.DockerClient:
        if self._client is not None:
            return self._client
        async with self._client_lock:
            if self._client is None:
                try:
                    # "auto" negotiates the API version, so older engines work.
                    self._client = await asyncio.to_thread(docker.from_env, version="auto", timeout=120)
                except docker.errors.DockerException as exc:
                    raise BackendUnavailable(f"cannot reach the Docker engine: {exc}") from exc
            return self._client

    async def _call(self, fn: Callable[[], _T]) -> _T:
        """Runs a blocking SDK call in a thread; an unreachable engine becomes
        BackendUnavailable, other engine errors BackendError. NotFound passes
        through for the callers that expect it."""
        try:
            return await asyncio.to_thread(fn)
        except docker.errors.NotFound:
            raise
        except docker.errors.APIError as exc:
            raise BackendError(f"docker: {exc.explanation or exc}") from exc
        except docker.errors.DockerException as exc:
            raise BackendUnavailable(f"docker engine unavailable: {exc}") from exc
        except OSError as exc:  # requests' connection errors are OSErrors
            raise BackendUnavailable(f"docker engine unavailable: {exc}") from exc

    async def _get(self, ref: str) -> Container | None:
        if not ref:
            return None
        client = await self._docker()
        try:
            return await self._call(lambda: client.containers.get(ref))
        except docker.errors.NotFound:
            return None

    async def _find(self, sandbox_id: str) -> Container | None:
        container = await self._get(self._container_name(sandbox_id))
        if container is not None and container.labels.get(_INSTALLATION) != self._installation:
            raise BackendError(f"container {container.name} exists but belongs to another installation")
        return container

    async def _live_container(self, handle: BackendHandle) -> Container:
        container = await self._get(str(handle.private.get("container_id", "")))
        if container is None or container.status not in _LIVE_STATES:
            raise SandboxGone(f"sandbox {handle.sandbox_id} is not running")
        return container

    async def _toggle_pause(self, container: Container, *, pause: bool) -> None:
        try:
            await self._call(container.pause if pause else container.unpause)
        except BackendError:
            # Another replica or an operator may have got there first (409).
            await self._call(container.reload)
            if (container.status == "paused") != pause:
                raise

    async def _remove_container(self, container: Container) -> None:
        try:
            # Force kills every process, paused ones included.
            await self._call(lambda: container.remove(force=True, v=True))
        except docker.errors.NotFound:
            return
        except BackendError:
            # "removal already in progress": wait for whoever started it.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30.0
            while await self._get(container.id or "") is not None:
                if loop.time() >= deadline:
                    raise
                await asyncio.sleep(0.1)

    # ------------------------------------------------------------ starting

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    def _paths(self, sandbox_id: str) -> _Paths:
        home = self._data_dir / "sandboxes" / sandbox_id
        return _Paths(home=home, workspace=home / "workspace", run=home / "run")

    def _container_name(self, sandbox_id: str) -> str:
        return f"berth-{self._installation}-{sandbox_id}"

    def _handle_for(self, container: Container) -> BackendHandle:
        labels = container.labels
        sandbox_id = labels[_SANDBOX_LABEL]
        paths = self._paths(sandbox_id)
        return BackendHandle(
            sandbox_id=sandbox_id,
            socket_path=str(paths.socket),
            private={
                "container_id": container.id,
                "container_name": container.name,
                "image": str(container.attrs.get("Config", {}).get("Image", self._image)),
                "installation": self._installation,
                "network": labels.get(_NETWORK_LABEL, "disabled"),
                "home": str(paths.home),
                "workspace_dir": str(paths.workspace),
                "run_dir": str(paths.run),
                "labels": {k: v for k, v in labels.items() if k not in (_MANAGED, _INSTALLATION, _NETWORK_LABEL, "berth.data_dir")},
            },
        )

    def _sandbox_env(self, spec: SandboxSpec, ca_mounted: bool) -> dict[str, str]:
        env = _proxy_env(self._settings)
        if ca_mounted:
            env.update({name: _CA_IN_SANDBOX for name in _CA_ENV})
        env.update(spec.env)
        return env

    def _ca_bundle(self) -> Path | None:
        configured = self._settings.sandbox_ca_bundle.strip()
        if configured:
            path = Path(configured)
            if not path.is_file():
                raise BackendError(f"BERTH_SANDBOX_CA_BUNDLE {configured} is not a readable file")
            return path
        return _HOST_CA_BUNDLE if _HOST_CA_BUNDLE.is_file() else None

    async def _network_mode(self, policy: NetworkPolicy, sandbox_id: str) -> tuple[NetworkPolicy, dict[str, Any]]:
        """The effective policy and the run() arguments that implement it."""
        if policy == "restricted":
            log.warning("sandbox_network_restricted_is_disabled", sandbox_id=sandbox_id, backend="docker")
            policy = "disabled"
        if policy == "disabled":
            return policy, {"network_mode": "none"}
        network = await self._enabled_network_name()
        if network in ("host", "bridge"):
            return policy, {"network_mode": network}
        return policy, {"network": network}

    async def _enabled_network_name(self) -> str:
        if self._enabled_network is not None:
            return self._enabled_network
        async with self._network_lock:
            if self._enabled_network is not None:
                return self._enabled_network
            client = await self._docker()
            wanted = self._network_setting
            if wanted == "host":
                log.warning("sandbox_network_host", detail="sandboxes with network share the host's network stack")
            elif wanted:
                await self._ensure_network(client, wanted)
            else:
                try:
                    await self._call(lambda: client.networks.get("bridge"))
                    wanted = "bridge"
                except docker.errors.NotFound:
                    # Engine runs with --bridge=none: use our own bridge network.
                    wanted = AUTO_NETWORK
                    await self._ensure_network(client, wanted)
            self._enabled_network = wanted
            return wanted

    async def _ensure_network(self, client: docker.DockerClient, name: str) -> None:
        try:
            await self._call(lambda: client.networks.get(name))
            return
        except docker.errors.NotFound:
            pass
        try:
            await self._call(
                lambda: client.networks.create(name, driver="bridge", check_duplicate=True, labels={_MANAGED: "1"})
            )
            log.info("sandbox_network_created", network=name)
        except BackendError:
            # Lost a race with another replica; the network exists now.
            await self._call(lambda: client.networks.get(name))

    async def _cpu_limit(self, client: docker.DockerClient, cpu_millis: int | None) -> int | None:
        if not cpu_millis:
            return None
        if self._engine_cpus is None:
            info = await self._call(client.info)
            self._engine_cpus = max(1, int(info.get("NCPU") or 1))
        # The engine refuses a limit above its CPU count.
        return min(cpu_millis, self._engine_cpus * 1000) * 1_000_000

    async def _start(self, spec: SandboxSpec) -> BackendHandle:
        client = await self._docker()
        try:
            await self._call(lambda: client.images.get(self._image))
        except docker.errors.NotFound:
            raise BackendUnavailable(
                f"sandbox image {self._image} is not on the Docker engine: build it (deploy/images/build-base.sh) "
                "or pull it on every sandbox node, or set BERTH_DOCKER_IMAGE"
            ) from None

        paths = self._paths(spec.sandbox_id)
        shared = self._data_dir / "docker"
        ca_source = self._ca_bundle()

        def prepare() -> tuple[Path, Path | None]:
            paths.workspace.mkdir(parents=True, exist_ok=True)
            paths.run.mkdir(mode=0o700, parents=True, exist_ok=True)
            (paths.run / "state").mkdir(mode=0o700, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                paths.socket.unlink()
            daemon = _copy_by_content(_DAEMON_SOURCE, shared, "sandboxd", ".py", self._copies)
            ca = None if ca_source is None else _copy_by_content(ca_source, shared, "ca-bundle", ".crt", self._copies)
            return daemon, ca

        daemon_file, ca_file = await asyncio.to_thread(prepare)
        env_file = paths.run / "env.json"
        env_file.write_text(json.dumps(self._sandbox_env(spec, ca_file is not None)))
        env_file.chmod(0o600)

        network, network_args = await self._network_mode(spec.network, spec.sandbox_id)
        mounts = [
            Mount("/workspace", str(paths.workspace), type="bind"),
            Mount(_RUN_IN_SANDBOX, str(paths.run), type="bind"),
            Mount(_DAEMON_IN_SANDBOX, str(daemon_file), type="bind", read_only=True),
        ]
        if ca_file is not None:
            mounts.append(Mount(_CA_IN_SANDBOX, str(ca_file), type="bind", read_only=True))
        labels = {
            **{str(k): str(v) for k, v in spec.labels.items()},
            _MANAGED: "1",
            _INSTALLATION: self._installation,
            _SANDBOX_LABEL: spec.sandbox_id,
            _NETWORK_LABEL: network,
            "berth.data_dir": str(self._data_dir),
        }
        limits: dict[str, Any] = {"pids_limit": _PIDS_LIMIT}
        nano_cpus = await self._cpu_limit(client, spec.cpu_millis)
        if nano_cpus:
            limits["nano_cpus"] = nano_cpus
        if spec.memory_mib:
            limits["mem_limit"] = f"{spec.memory_mib}m"
            limits["memswap_limit"] = f"{spec.memory_mib}m"

        name = self._container_name(spec.sandbox_id)
        container: Container = await self._call(
            lambda: client.containers.run(
                self._image,
                entrypoint=["python3", _DAEMON_IN_SANDBOX],
                command=[
                    "--socket", f"{_RUN_IN_SANDBOX}/sandboxd.sock",
                    "--workspace", "/workspace",
                    "--state-dir", f"{_RUN_IN_SANDBOX}/state",
                    "--isolation", "docker",
                    "--env-file", f"{_RUN_IN_SANDBOX}/env.json",
                ],  # fmt: skip
                name=name,
                hostname="sandbox",
                working_dir="/workspace",
                detach=True,
                labels=labels,
                mounts=mounts,
                # Keep what a root process inside may do close to an ordinary
                # package-installing user: no raw sockets, device nodes or
                # setuid escalation.
                cap_drop=["NET_RAW", "MKNOD", "AUDIT_WRITE", "SETFCAP"],
                security_opt=["no-new-privileges"],
                log_config={"type": "json-file", "config": {"max-size": "1m", "max-file": "1"}},
                **network_args,
                **limits,
            )
        )
        # run() returns the container as inspected at creation, which is all
        # a handle needs; readiness comes from the daemon, not the engine.
        handle = self._handle_for(container)
        try:
            await self._wait_ready(handle, container)
        except BaseException:
            with contextlib.suppress(BackendError, docker.errors.DockerException):
                await self._remove_container(container)
            raise
        log.info(
            "sandbox_started",
            sandbox_id=spec.sandbox_id,
            backend="docker",
            container=name,
            network=network,
            image=self._image,
        )
        return handle

    async def _wait_ready(self, handle: BackendHandle, container: Container) -> None:
        """Waits for sandboxd to answer on its socket. The socket file is
        checked often (cheap); the engine is asked whether the container
        died only every ``_INSPECT_S``, as each inspect is an API round trip."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._start_timeout_s
        next_inspect = loop.time() + _INSPECT_S
        last_error: Exception | None = None
        while loop.time() < deadline:
            last_error = await probe(handle.socket_path)
            if last_error is None:
                return
            if loop.time() >= next_inspect:
                await self._call(container.reload)
                if container.status not in ("created", "running"):
                    raise SandboxStartError(
                        f"sandbox {handle.sandbox_id} container is {container.status} while starting: "
                        f"{await self._log_tail(container)}"
                    )
                next_inspect = loop.time() + _INSPECT_S
            await asyncio.sleep(_POLL_S)
        raise SandboxStartError(
            f"sandbox daemon {handle.sandbox_id} not ready after {self._start_timeout_s}s "
            f"({last_error!r}): {await self._log_tail(container)}"
        )

    async def _log_tail(self, container: Container) -> str:
        try:
            data: bytes = await self._call(lambda: container.logs(tail=40))
        except (BackendError, docker.errors.DockerException):
            return "(no log)"
        return data[-2000:].decode(errors="replace").strip()

    # ------------------------------------------------------------ deleting

    async def _remove_tree(self, home: Path) -> None:
        await asyncio.to_thread(shutil.rmtree, home, True)
        if home.exists() and os.geteuid() != 0:
            # Files written by root inside the container cannot be removed by
            # an unprivileged service; a throwaway container removes them.
            client = await self._docker()
            await self._call(
                lambda: client.containers.run(
                    self._image,
                    ["sh", "-c", "rm -rf /target/* /target/.[!.]* /target/..?*"],
                    mounts=[Mount("/target", str(home), type="bind")],
                    network_mode="none",
                    remove=True,
                )
            )
            await asyncio.to_thread(shutil.rmtree, home, True)
        if home.exists():
            raise BackendError(f"could not delete {home}")
