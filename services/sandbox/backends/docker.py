"""The ``docker`` backend: one container per sandbox, sandboxd as its entrypoint.

Layout of one sandbox on the host (``<data_dir>`` resolved to an absolute path)::

    <data_dir>/sandboxes/<sandbox_id>/
        workspace/        bind-mounted read-write at /workspace
        run/              bind-mounted at /run/berth: sandboxd.sock, env.json, state/
        pool-claim.json   only for a sandbox made of a warm pool container (see below)
    <data_dir>/docker/
        sandboxd-<hash>.py          bind-mounted read-only at /opt/berth/sandboxd.py
        ca-bundle-<hash>.crt        bind-mounted read-only at /opt/berth/ca-certificates.crt
        pool/<slot>/                a warm pool container's workspace/ and run/

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
A claimed warm pool container differs (see "Warm pool").

Reconciliation (``adopt``): containers of this installation that are running
or paused are adopted. A container whose sandbox directory is gone is an
orphan and is removed. Pool containers no sandbox claimed, and their slot
directories, are removed too. An exited container with its directory in place is
left for inspection (``docker logs``); ``create`` of the same ID replaces it
and reuses the workspace, ``destroy`` removes it. Reaping sandboxes whose
environment no longer exists is the Environment service's decision: its
reconciler (``services/environment/sandbox_reconciler.py``) lists them with
ListLabeledSandboxes and destroys them through DestroySandbox.

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
* ``restricted``: ``network_mode=none`` as well, so no connection leaves
  the container directly. The Sandbox service serves the sandbox's egress
  proxy (``services/sandbox/egress.py``) on ``run/egress.sock``, which the
  ``run/`` mount already puts at ``/run/berth/egress.sock``; sandboxd relays
  ``127.0.0.1:3128`` to it and the commands' ``HTTP(S)_PROXY`` variables
  point there (``base.egress_env``, replacing the host proxy's, which the
  egress proxy chains through instead). The handle records ``restricted``,
  and so does the ``berth.network`` label of a fresh container (a claimed
  one keeps its pool's, see "Warm pool").

Containers run the image's user (root in the Berth images) with Docker's
default capabilities minus NET_RAW, MKNOD, AUDIT_WRITE and SETFCAP, and
with ``no-new-privileges``: package installs work, raw sockets, device
nodes and setuid escalation do not. sandboxd is PID 1 and reaps orphans.

Pause and resume are ``docker pause``/``unpause`` (the cgroup freezer).
CPU and memory limits come from the spec (CPU clamped to the engine's CPU
count, which the engine requires); swap is not granted beyond the memory
limit and a PID limit stops fork bombs.

Warm pool
---------
On the vfs storage driver ``docker create`` alone copies the image (1-2 s),
so the backend keeps ``settings.docker_pool_size`` containers started ahead
in each warm pool. Only a container's network is fixed when it is created;
everything else can be applied later. So there is one pool per network a
container is created with: ``enabled`` (on the enabled network above) and
``disabled`` (``network_mode=none``), which serves ``restricted`` sandboxes
too. They have no network either, and what makes them restricted is
applied at the claim (the egress proxy variables, in env.json) or after any
create, pooled or not: the manager serves the proxy on the sandbox's
``run/egress.sock`` and starts sandboxd's relay to it. A sandbox ID whose
directory exists (its workspace is reused) gets a fresh container.

Which pools are warm: those of ``settings.docker_pool_networks`` (default
``enabled,disabled``, hence all three policies) fill from ``start()``; any
other starts filling after the first create that needs it. From then on
every create tops up its pool once the create itself is done, in the
background and one container at a time (the pools take turns). The price is disk and engine work:
on vfs each container holds two full copies of the image (its init layer
and its own, about 350 MB for ``berth-sandbox``), so the defaults (two
pools of 2) hold about 1.4 GB, and a pool used once stays warm until the
service stops (on overlay2 a container costs next to nothing). An
installation that uses a single policy lists only that one; an empty list
pools only what is used. The pool stays off when ``docker/pool/`` and
``sandboxes/`` are on different filesystems, because a claim's rename
cannot cross them. A pool container is started by the same code as a
sandbox's, without env, labels or limits, in
``<data_dir>/docker/pool/<slot>/``, named ``berth-<installation>.pool-<slot>``
(``.`` never occurs in a sandbox ID) and labelled ``berth.pool=<slot>``
instead of ``berth.sandbox_id``.

``create`` claims the oldest ready one (taken without an await, so two
creates never share one): the slot directory is renamed to the sandbox's
(a bind mount holds the directory, not its path, so the running container
keeps its workspace and socket; ``docker inspect`` keeps showing the slot
path, which matters only to a ``docker start`` of an exited container,
which Berth never does), ``pool-claim.json`` records the sandbox ID, its
labels and network, then at once the container is renamed to
``berth-<installation>-<sandbox_id>``, gets the spec's limits with
``docker update`` (a CFS quota over a 100 ms period, which is what NanoCpus
becomes) and sandboxd re-reads ``env.json``, rewritten with the spec's
variables (``env.reload``). Its answer also proves the container alive; a
pool container that fails any step, mounts an outdated sandboxd or CA
bundle, or is not on the network a fresh container would get now (an
operator disconnected it, say) is removed and the next one (or a fresh
container) is used. The user sees no difference from a fresh container:
the same env, limits, empty ``/workspace``, hostname, mounts and network.

Labels cannot change, so a claimed container keeps ``berth.pool`` and its
pool's ``berth.network`` (``disabled`` for a restricted sandbox), and lacks
the sandbox's labels: its handle takes them from ``pool-claim.json`` (kept
in the sandbox directory, outside the container's mounts, so the sandbox
cannot rewrite it), and ``adopt`` takes a pool container as a sandbox only
when its name and that record agree. ``close()`` removes the unclaimed pool
containers (after a fill in progress ends); whatever a crash leaves, the
next ``adopt`` removes, so no container pooled under an earlier
configuration (another ``docker_network``, image or sandboxd) is ever
claimed, and exactly one service process should use a data dir.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Awaitable, Callable
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
    egress_env,
    proxy_env,
)
from services.sandbox.backends._warm_pool import WarmPool
from services.sandbox.daemon_client import DaemonClient, DaemonError, DaemonUnavailable, probe

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
_CFS_PERIOD_US = 100_000
_POLL_S = 0.01
_INSPECT_S = 0.25
_MANAGED = "berth.managed"
_INSTALLATION = "berth.installation"
_SANDBOX_LABEL = "berth.sandbox_id"
_NETWORK_LABEL = "berth.network"
_POOL_LABEL = "berth.pool"
# Labels every container of the installation carries, not the sandbox's own.
_INTERNAL_LABELS = (_MANAGED, _INSTALLATION, _NETWORK_LABEL, _POOL_LABEL, "berth.data_dir")
_CLAIM_FILE = "pool-claim.json"
# A claim that fails here discards the pool container and tries the next one.
_CLAIM_ERRORS = (BackendError, DaemonError, DaemonUnavailable, OSError, ValueError, docker.errors.DockerException)

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


@dataclass(frozen=True)
class _Claim:
    """What made a pool container a sandbox. Docker labels cannot change, so
    this is kept in the sandbox's directory, outside the container's mounts
    (its processes cannot rewrite it)."""

    sandbox_id: str
    container_id: str
    labels: dict[str, str]
    network: str

    def to_json(self) -> str:
        return json.dumps(
            {"sandbox_id": self.sandbox_id, "container_id": self.container_id, "labels": self.labels, "network": self.network}
        )

    @classmethod
    def from_json(cls, text: str) -> _Claim:
        raw = json.loads(text)
        labels = raw["labels"]
        if not isinstance(labels, dict):
            raise ValueError("labels is not an object")
        return cls(
            sandbox_id=str(raw["sandbox_id"]),
            container_id=str(raw["container_id"]),
            labels={str(k): str(v) for k, v in labels.items()},
            network=str(raw["network"]),
        )


@dataclass(frozen=True)
class _PoolEntry:
    """A started pool container whose sandboxd answers, in its slot directory."""

    slot: str
    container: Container


def _pool_key(network: NetworkPolicy) -> NetworkPolicy:
    """The warm pool serving sandboxes with ``network``. Only a container's
    network is fixed at its creation: a restricted sandbox has none either
    (its proxy variables come with env.json at the claim), so it is served
    by the pool of ``disabled``."""
    return "enabled" if network == "enabled" else "disabled"


def _on_network(attrs: dict[str, Any], network: str) -> bool:
    """Whether inspect data show the container on ``network`` alone (``none``,
    ``host``, ``bridge`` or a network's name), as a fresh container would be."""
    networks = (attrs.get("NetworkSettings") or {}).get("Networks") or {}
    return (attrs.get("HostConfig") or {}).get("NetworkMode") == network and set(networks) == {network}


def _mount_sources(container: Container) -> dict[str, str]:
    """Bind mount target -> host source, as the container was created."""
    mounts = container.attrs.get("HostConfig", {}).get("Mounts") or []
    return {str(m.get("Target")): str(m.get("Source")) for m in mounts}


def _write_private(path: Path, text: str) -> None:
    """Replaces ``path`` at once (a reader never sees half a file), mode 0600."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.chmod(0o600)
    tmp.replace(path)


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
        # Unique per call: threads of one process may copy the same file at once.
        tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
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
        self._pool: WarmPool[NetworkPolicy, _PoolEntry] = WarmPool(
            settings.docker_pool_size, self._make_pool_container, self._discard_pool_container, name="docker-pool"
        )
        # Slots this instance's pool made and has not handed out; adopt keeps them.
        self._pool_slots: set[str] = set()

    # ------------------------------------------------------------ public interface

    def socket_path(self, handle: BackendHandle) -> str:
        return handle.socket_path

    async def create(self, spec: SandboxSpec) -> BackendHandle:
        if not _SANDBOX_ID.match(spec.sandbox_id):
            raise BackendError(f"invalid sandbox id {spec.sandbox_id!r}")
        async with self._lock(spec.sandbox_id):
            existing = await self._find(spec.sandbox_id)
            if existing is not None:
                pooled = _POOL_LABEL in existing.labels
                claim = self._claim_of(existing) if pooled else None
                if existing.status in _LIVE_STATES and (claim is not None or not pooled):
                    return self._handle_for(existing, claim)
                # An exited container (or a pool container whose claim never
                # finished) cannot be brought into a known state; a fresh one
                # takes over its workspace.
                await self._remove_container(existing)
                if pooled:
                    (self._paths(spec.sandbox_id).home / _CLAIM_FILE).unlink(missing_ok=True)
            try:
                handle = await self._create_from_pool(spec)
                return handle if handle is not None else await self._start(spec)
            finally:
                # After the create, not competing with it: a policy in use is
                # kept warm from now on, whether it was pre-filled or not.
                self._pool.refill(_pool_key(spec.network))

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
            claim: _Claim | None = None
            slot = container.labels.get(_POOL_LABEL)
            if slot is not None:
                if slot in self._pool_slots:
                    continue  # this instance's own warm pool
                claim = self._claim_of(container)
                if claim is None:
                    # Warm but never (or not completely) claimed: nothing of a
                    # sandbox is lost with it. Its slot directory goes below.
                    log.info("pool_container_removed", container=container.name)
                    await self._remove_container(container)
                    continue
                sandbox_id = claim.sandbox_id
            else:
                sandbox_id = container.labels.get(_SANDBOX_LABEL, "")
            if not _SANDBOX_ID.match(sandbox_id):
                continue
            if not self._paths(sandbox_id).home.is_dir():
                log.warning("sandbox_orphan_removed", sandbox_id=sandbox_id, container=container.name)
                await self._remove_container(container)
                continue
            if container.status in _LIVE_STATES:
                handles.append(self._handle_for(container, claim))
        await self._remove_stale_slots()
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

    async def start(self) -> None:
        """Starts filling the warm pools of ``docker_pool_networks``
        (``docker_pool_size`` containers each); every other pool starts
        filling after its first create."""
        if self._pool.size == 0:
            return
        sandboxes, pool = self._data_dir / "sandboxes", self._data_dir / "docker" / "pool"

        def same_filesystem() -> bool:
            sandboxes.mkdir(parents=True, exist_ok=True)
            pool.mkdir(parents=True, exist_ok=True)
            return sandboxes.stat().st_dev == pool.stat().st_dev

        # A claim renames a slot directory into sandboxes/, which cannot
        # cross filesystems: every claim would fail and cost a refill.
        if not await asyncio.to_thread(same_filesystem):
            log.warning("docker_pool_disabled", reason=f"{sandboxes} and {pool} are on different filesystems")
            return
        self._pool.start(list(dict.fromkeys(_pool_key(n) for n in self._settings.docker_pool_networks)))

    async def close(self) -> None:
        """Removes the warm pool's unclaimed containers and slot directories
        (after letting a fill in progress finish); sandboxes keep running."""
        await self._pool.close()

    @property
    def pool_size(self) -> int:
        """Pool containers kept ready per pool (``enabled``, and ``disabled``
        which also serves ``restricted``)."""
        return self._pool.size

    def warm_count(self, network: NetworkPolicy = "disabled") -> int:
        """Pool containers ready to be claimed by a sandbox with ``network``."""
        return self._pool.ready(_pool_key(network))

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

    def _slot_paths(self, slot: str) -> _Paths:
        home = self._data_dir / "docker" / "pool" / slot
        return _Paths(home=home, workspace=home / "workspace", run=home / "run")

    def _pool_container_name(self, slot: str) -> str:
        # "." never occurs in a sandbox ID, so no sandbox's name can clash.
        return f"berth-{self._installation}.pool-{slot}"

    def _handle_for(self, container: Container, claim: _Claim | None = None) -> BackendHandle:
        """The handle of a sandbox's container; with ``claim``, of a claimed
        pool container (whose name and labels are the claim's). An unclaimed
        pool container's handle names its slot instead of a sandbox."""
        labels = dict(container.labels)
        slot = labels.get(_POOL_LABEL)
        if claim is not None:
            sandbox_id, name, paths = claim.sandbox_id, self._container_name(claim.sandbox_id), self._paths(claim.sandbox_id)
            labels.update(claim.labels)
            labels[_NETWORK_LABEL] = claim.network
        elif slot is not None:
            sandbox_id, name, paths = slot, str(container.name), self._slot_paths(slot)
        else:
            sandbox_id, name, paths = labels[_SANDBOX_LABEL], str(container.name), self._paths(labels[_SANDBOX_LABEL])
        return BackendHandle(
            sandbox_id=sandbox_id,
            socket_path=str(paths.socket),
            private={
                "container_id": container.id,
                "container_name": name,
                "image": str(container.attrs.get("Config", {}).get("Image", self._image)),
                "installation": self._installation,
                "network": labels.get(_NETWORK_LABEL, "disabled"),
                "home": str(paths.home),
                "workspace_dir": str(paths.workspace),
                "run_dir": str(paths.run),
                "labels": {k: v for k, v in labels.items() if k not in _INTERNAL_LABELS},
            },
        )

    def _claim_of(self, container: Container) -> _Claim | None:
        """The claim of a pool container named as a sandbox, from the record
        in that sandbox's directory; None when it is not (completely) claimed."""
        prefix = f"berth-{self._installation}-"
        name = str(container.name or "")
        sandbox_id = name[len(prefix) :]
        if not name.startswith(prefix) or not _SANDBOX_ID.match(sandbox_id):
            return None
        try:
            claim = _Claim.from_json((self._paths(sandbox_id).home / _CLAIM_FILE).read_text())
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if claim.sandbox_id != sandbox_id or claim.container_id != container.id:
            return None
        return claim

    def _sandbox_env(self, spec: SandboxSpec, ca_mounted: bool) -> dict[str, str]:
        env = egress_env() if spec.network == "restricted" else _proxy_env(self._settings)
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
        """The effective policy and the run() arguments that implement it. A
        restricted sandbox has no network either: its egress proxy is reached
        through the ``run/`` mount."""
        if policy in ("disabled", "restricted"):
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

    async def _start(self, spec: SandboxSpec, *, pool_slot: str | None = None) -> BackendHandle:
        """Starts a fresh container for ``spec``. With ``pool_slot`` it is a
        warm pool container instead: in the slot's directory, under the
        slot's name, labelled as a pool container rather than a sandbox."""
        client = await self._docker()
        try:
            await self._call(lambda: client.images.get(self._image))
        except docker.errors.NotFound:
            raise BackendUnavailable(
                f"sandbox image {self._image} is not on the Docker engine: build it (deploy/images/build-base.sh) "
                "or pull it on every sandbox node, or set BERTH_DOCKER_IMAGE"
            ) from None

        paths = self._paths(spec.sandbox_id) if pool_slot is None else self._slot_paths(pool_slot)

        def prepare() -> tuple[Path, Path | None]:
            paths.workspace.mkdir(parents=True, exist_ok=True)
            paths.run.mkdir(mode=0o700, parents=True, exist_ok=True)
            (paths.run / "state").mkdir(mode=0o700, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                paths.socket.unlink()
            return self._shared_files()

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
        if pool_slot is not None:
            # Labels cannot change later: a claim is recorded in the
            # sandbox's directory instead (see _Claim).
            del labels[_SANDBOX_LABEL]
            labels[_POOL_LABEL] = pool_slot
        limits: dict[str, Any] = {"pids_limit": _PIDS_LIMIT}
        nano_cpus = await self._cpu_limit(client, spec.cpu_millis)
        if nano_cpus:
            limits["nano_cpus"] = nano_cpus
        if spec.memory_mib:
            limits["mem_limit"] = f"{spec.memory_mib}m"
            limits["memswap_limit"] = f"{spec.memory_mib}m"

        name = self._container_name(spec.sandbox_id) if pool_slot is None else self._pool_container_name(pool_slot)
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
            "sandbox_started" if pool_slot is None else "pool_container_started",
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

    # ------------------------------------------------------------ warm pool

    def _shared_files(self) -> tuple[Path, Path | None]:
        """sandboxd and the CA bundle as a container started now mounts them
        (blocking: may read and copy the files)."""
        shared = self._data_dir / "docker"
        ca_source = self._ca_bundle()
        daemon = _copy_by_content(_DAEMON_SOURCE, shared, "sandboxd", ".py", self._copies)
        ca = None if ca_source is None else _copy_by_content(ca_source, shared, "ca-bundle", ".crt", self._copies)
        return daemon, ca

    async def _make_pool_container(self, network: NetworkPolicy) -> _PoolEntry:
        # Asks the engine its CPU count now rather than during a claim.
        await self._cpu_limit(await self._docker(), 1)
        slot = secrets.token_hex(6)
        self._pool_slots.add(slot)
        try:
            handle = await self._start(SandboxSpec(sandbox_id=slot, network=network), pool_slot=slot)
            container = await self._get(str(handle.private["container_id"]))
            if container is None or container.status != "running":
                raise SandboxStartError(f"pool container {handle.private['container_name']} stopped after starting")
        except BaseException:
            with contextlib.suppress(*_CLAIM_ERRORS):
                await self._discard_slot(slot, None)
            raise
        return _PoolEntry(slot=slot, container=container)

    async def _discard_pool_container(self, entry: _PoolEntry) -> None:
        await self._discard_slot(entry.slot, entry.container)

    async def _discard_slot(self, slot: str, container: Container | None) -> None:
        try:
            if container is None:
                # run() leaves a container it created but could not start.
                container = await self._get(self._pool_container_name(slot))
            if container is not None:
                await self._remove_container(container)
            await self._remove_tree(self._slot_paths(slot).home)
        finally:
            self._pool_slots.discard(slot)

    async def _remove_stale_slots(self) -> None:
        """Removes the slot directories this instance's pool does not use
        (adopt has removed every other unclaimed pool container)."""
        root = self._data_dir / "docker" / "pool"
        keep = set(self._pool_slots)

        def stale() -> list[Path]:
            return [path for path in root.iterdir() if path.name not in keep] if root.is_dir() else []

        for home in await asyncio.to_thread(stale):
            await self._remove_tree(home)

    async def _create_from_pool(self, spec: SandboxSpec) -> BackendHandle | None:
        """``spec``'s sandbox made of a warm pool container, or None when the
        pool holds none for it. Only new sandboxes are: an existing workspace
        is reused, and only a fresh container can mount it. A pool container
        that fails its claim (it died, say) is discarded for the next one."""
        paths = self._paths(spec.sandbox_id)
        if paths.home.exists():
            return None
        # take() awaits nothing, so concurrent creates never share an entry.
        while (entry := self._pool.take(_pool_key(spec.network))) is not None:
            self._pool_slots.discard(entry.slot)
            try:
                return await self._claim(entry, spec, paths)
            except _CLAIM_ERRORS as exc:
                log.warning("pool_container_discarded", sandbox_id=spec.sandbox_id, slot=entry.slot, error=str(exc))
        return None

    async def _claim(self, entry: _PoolEntry, spec: SandboxSpec, paths: _Paths) -> BackendHandle:
        """Makes a pool container ``spec``'s sandbox. Its slot directory is
        renamed to the sandbox's: bind mounts hold the directories, not their
        paths, so the container keeps them (``docker inspect`` keeps showing
        the slot path). Then, at once: the container gets the sandbox's name
        and limits, and sandboxd re-reads env.json, now the sandbox's; its
        answer also proves the container alive. On any failure the container
        and the directory are removed. A container on another network than a
        fresh one would get now (an operator moved it, say) is refused like
        one with an outdated sandboxd."""
        client = await self._docker()
        container = entry.container
        container_id = str(container.id)
        slot_home = self._slot_paths(entry.slot).home
        moved = False
        try:
            mounts = _mount_sources(container)
            daemon_file, ca_file = await asyncio.to_thread(self._shared_files)
            if mounts.get(_DAEMON_IN_SANDBOX) != str(daemon_file) or mounts.get(_CA_IN_SANDBOX) != (
                None if ca_file is None else str(ca_file)
            ):
                raise BackendError("pool container mounts an outdated sandboxd or CA bundle")
            _, network_args = await self._network_mode(spec.network, spec.sandbox_id)
            network = str(network_args.get("network_mode") or network_args["network"])
            if not _on_network(container.attrs, network):
                raise BackendError(f"pool container is not on the network {network}")
            claim = _Claim(
                sandbox_id=spec.sandbox_id,
                container_id=container_id,
                labels={**{str(k): str(v) for k, v in spec.labels.items()}, _SANDBOX_LABEL: spec.sandbox_id},
                network=spec.network,
            )
            env = json.dumps(self._sandbox_env(spec, ca_file is not None))
            update = await self._limits_update(client, spec)

            def move_in() -> None:
                nonlocal moved
                paths.home.parent.mkdir(parents=True, exist_ok=True)
                os.rename(slot_home, paths.home)
                moved = True
                # Before the rename of the container: adopt takes a container
                # named as a sandbox only with its claim record.
                _write_private(paths.home / _CLAIM_FILE, claim.to_json())
                _write_private(paths.run / "env.json", env)

            await asyncio.to_thread(move_in)
            name = self._container_name(spec.sandbox_id)
            steps: list[Awaitable[object]] = [
                self._call(lambda: client.api.rename(container_id, name)),
                self._reload_env(paths.socket),
            ]
            if network not in ("none", "host"):
                # Unlike none and host, a network can be disconnected after
                # creation. Checked alongside the other steps, whose effects a
                # failure undoes.
                steps.append(self._check_attached(client, container_id, network))
            if update:
                steps.append(self._call(lambda: client.api.update_container(container_id, **update)))
            for result in await asyncio.gather(*steps, return_exceptions=True):
                if isinstance(result, BaseException):
                    raise result
        except BaseException:
            with contextlib.suppress(*_CLAIM_ERRORS):
                await self._discard_slot(entry.slot, container)
            if moved:
                with contextlib.suppress(*_CLAIM_ERRORS):
                    await self._remove_tree(paths.home)
            raise
        log.info(
            "sandbox_started",
            sandbox_id=spec.sandbox_id,
            backend="docker",
            container=name,
            network=spec.network,
            image=self._image,
            pool_slot=entry.slot,
        )
        return self._handle_for(container, claim)

    async def _limits_update(self, client: docker.DockerClient, spec: SandboxSpec) -> dict[str, Any]:
        """``update_container`` arguments for the spec's limits. The update
        API takes a CFS quota, not NanoCpus; with the period the engine uses
        for NanoCpus (100 ms) the container's cgroup ends up the same."""
        update: dict[str, Any] = {}
        nano_cpus = await self._cpu_limit(client, spec.cpu_millis)
        if nano_cpus:
            update["cpu_period"] = _CFS_PERIOD_US
            update["cpu_quota"] = nano_cpus * _CFS_PERIOD_US // 1_000_000_000
        if spec.memory_mib:
            update["mem_limit"] = f"{spec.memory_mib}m"
            update["memswap_limit"] = f"{spec.memory_mib}m"
        return update

    async def _check_attached(self, client: docker.DockerClient, container_id: str, network: str) -> None:
        attrs: dict[str, Any] = await self._call(lambda: client.api.inspect_container(container_id))
        if not _on_network(attrs, network):
            raise BackendError(f"pool container is no longer on the network {network}")

    async def _reload_env(self, socket: Path) -> None:
        daemon = DaemonClient(str(socket), connect_timeout_s=2.0, request_timeout_s=5.0)
        try:
            await daemon.reload_env()
        finally:
            await daemon.close()

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
