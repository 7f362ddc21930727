"""The ``docker`` backend: one container per sandbox, sandboxd as its entrypoint.

Layout of one sandbox on the host (``<data_dir>`` resolved to an absolute path)::

    <data_dir>/sandboxes/<sandbox_id>/      root's; nothing of it but the two mounts below reaches the container
        workspace.ext4    the workspace filesystem (sparse image, the disk quota)
        workspace/        its mount point, bind-mounted read-write at /workspace
        run/              owned by the sandbox's uid, bind-mounted at /run/berth:
                          sandboxd.sock, env.json, state/, egress.sock (restricted)
        user-network.json the slirp4netns process of an ``enabled`` sandbox (pid, start time)
        slirp4netns.log   its log
        pool-claim.json   only for a sandbox made of a warm pool container (see below)
    <data_dir>/docker/
        sandboxd-<hash>.pyz         bind-mounted read-only at /opt/berth/sandboxd.pyz (``daemon/bundle.py``)
        ca-bundle-<hash>.crt        bind-mounted read-only at /opt/berth/ca-certificates.crt
        pool/<slot>/                a warm pool container's directory, laid out as above

The workspace is a host directory rather than a named volume: the service
reads it while a sandbox is frozen, it survives the container (and the
engine) like the ``local`` backend's, and ``destroy`` deletes exactly what
``create`` made. sandboxd (built as one zipapp) and the CA bundle are
written into the data dir (named by content, so a running container's file
is never replaced) because the engine resolves bind sources on *its* host.

Where the service runs: as root, on the engine's host, in the host's PID,
mount and network namespaces. It loop-mounts each workspace (the engine must
see that mount), reads each container's ``/proc/<pid>`` (its network
namespace, its cgroup, its mounts) and runs slirp4netns beside it. In a
container of its own that means ``--pid=host --network=host --privileged``
and the data dir bound at the same path with ``rshared`` propagation; a
remote engine (``DOCKER_HOST=tcp://...``) cannot work. Each of these is
checked, and a create that cannot apply one fails (below).

Each container carries the labels ``berth.managed=1``,
``berth.installation=<hash of the data dir>``, ``berth.sandbox_id``,
``berth.network``, ``berth.size`` and the spec's labels (``berth.org``,
``berth.environment_id``). Its name is ``berth-<installation>-<sandbox_id>``,
so several installations (and test runs) share one engine without clashing.
A claimed warm pool container differs (see "Warm pool").

Reconciliation (``adopt``): containers of this installation that are running
or paused are adopted. A container whose sandbox directory is gone is an
orphan and is removed. Pool containers no sandbox claimed, and their slot
directories, are removed too (their filesystems unmounted first). An exited
container with its directory in place is left for inspection (``docker
logs``); ``create`` of the same ID replaces it and reuses the workspace
(its image, size and owner), ``destroy`` removes it. Reaping sandboxes whose
environment no longer exists is the Environment service's decision: its
reconciler (``services/environment/sandbox_reconciler.py``) lists them with
ListLabeledSandboxes and destroys them through DestroySandbox.

Isolation
---------
Nothing here can be turned off, and nothing falls back to less: a create
that cannot apply a piece fails with ``BackendUnavailable`` (this host
cannot do it: a missing tool, a service outside the host's PID or mount
namespace) or ``SandboxStartError`` (it failed for this sandbox), naming it.

* **Identity.** The container runs as its own unprivileged host uid and gid
  (``isolation/identity.py``, from the sandbox ID; a warm pool container's
  from its slot, since the user is fixed when a container is created), never
  root, with ``HOME=/workspace``. The image has no passwd entry for it, so
  ``id -un`` fails; nothing in Berth needs a name. The workspace filesystem
  and ``run/`` belong to that uid; the service (root) still reaches the
  socket. ``handle.private`` carries ``uid`` and ``gid``; a re-created
  sandbox keeps the uid that owns its workspace.
* **Privileges.** ``cap_drop=ALL`` and no capability added back: sandboxd
  and commands run as a plain user on files that user owns, bind no port
  below 1024 and change no ownership, so none is needed (package managers
  that want root, such as apt, do not work; pip, npm and the like install
  into the workspace). ``no-new-privileges`` (setuid binaries do not
  escalate), Docker's default seccomp profile (never ``unconfined``), a
  private IPC namespace.
* **Files.** The root filesystem is read-only. Writable are only
  ``/workspace``, ``/run/berth``, ``/tmp`` (a tmpfs of the size's
  ``tmp_mib``, ``nosuid,nodev`` but executable as in the ``local``
  backend), ``/run/berth/state`` (sandboxd's process logs, a tmpfs of the
  same size) and Docker's 64 MiB ``/dev/shm``; every tmpfs counts toward
  the memory limit. ``/etc/resolv.conf`` (``nameserver 10.0.2.3``, slirp4netns's
  DNS forwarder, for every policy) and ``/etc/hosts`` are the engine's.
* **Limits.** From ``spec.size`` (``isolation/sizes.py``): memory with
  ``memswap_limit`` equal to it (no swap beyond), ``pids_limit``,
  ``nano_cpus`` (clamped to the engine's CPU count, which the engine
  requires) and the workspace filesystem's size (``isolation/quota.py``: a
  loop-mounted ext4 image; a write past it fails with ENOSPC). The create
  checks in the container's own mount table that ``/workspace`` is that
  filesystem, so an engine that does not see the service's mounts fails
  instead of writing to the host's disk unbounded.
* **OOM.** ``oom_score_adj=500`` for the container: in a host-wide shortage
  sandboxes go before the host's own processes. Inside its memory cgroup
  the kernel kills the largest process, a command rather than sandboxd (a
  few MiB). A negative value is not used: the engine needs CAP_SYS_RESOURCE
  for it (the container does not start without), and every command would
  inherit it from sandboxd, protecting a hostile tenant's processes in a
  host-wide shortage rather than sandboxd from its own commands.

Network
-------
Every container is created with ``network_mode=none``, whatever its policy:
no bridge, no published port, no network shared with any other container or
organization (the engine refuses to connect a ``none`` container to a
network later).

* ``disabled``: only the loopback interface.
* ``enabled``: once the container runs (fresh, or claimed from the pool),
  the service loads the egress filter of ``isolation/network.py`` into the
  container's network namespace (``/proc/<pid>/ns/net``, after checking in
  ``/proc/<pid>/cgroup`` that the pid is the container's), then starts
  slirp4netns on it: user-mode TCP/IP whose connections are ordinary
  sockets of that process on the host. The filter rejects the host's
  loopback and own addresses, private, shared, link-local (cloud metadata)
  and reserved ranges, except ``BERTH_SANDBOX_ALLOW_CIDRS``. The slirp4netns
  pid and its start time are kept in ``user-network.json`` (and
  ``handle.private["user_network"]``); ``destroy`` kills that process, by
  pid and only while its start time still matches. slirp4netns runs in its
  own session, so it outlives a restart of the service like the container;
  if it dies the sandbox has no network (never a weaker one).
  ``BERTH_SANDBOX_*_PROXY`` become the commands' proxy variables.
* ``restricted``: only loopback as well. The Sandbox service serves the
  sandbox's egress proxy (``services/sandbox/egress.py``) on
  ``run/egress.sock``, which the ``run/`` mount already puts at
  ``/run/berth/egress.sock``; sandboxd relays ``127.0.0.1:3128`` to it and
  the commands' ``HTTP(S)_PROXY`` variables point there (``base.egress_env``,
  replacing the host proxy's, which the egress proxy chains through
  instead). The handle records ``restricted``, and so does the
  ``berth.network`` label of a fresh container (a claimed one keeps
  ``disabled``, see "Warm pool").

Pause and resume are ``docker pause``/``unpause`` (the cgroup freezer);
slirp4netns keeps running, outside the container. sandboxd is PID 1 and
reaps orphans.

Warm pool
---------
On the vfs storage driver ``docker create`` alone copies the image (1-2 s),
so the backend keeps ``settings.docker_pool_size`` containers started ahead.
The network policy does not matter to a container any more (all are
created without network; what ``enabled`` and ``restricted`` add is applied
after any create, pooled or not), but its ``container_size`` does: the
``/tmp`` tmpfs and the workspace filesystem are made with the container,
and an ext4 filesystem cannot grow while mounted without CAP_SYS_RESOURCE,
which a Sandbox service in a container often lacks. So there is one pool
per ``container_size``, each holding containers with that size's limits,
``/tmp`` and workspace. The pools of ``settings.docker_pool_sizes`` (default
``medium``, the SDK's default size) fill from ``start()``; the pool of any
other size starts filling after the first create that needs it. From then on every
create tops up its pool once the create itself is done, in the background
and one container at a time (the pools take turns). The price is disk and
engine work: on vfs each container holds two full copies of the image
(about 350 MB for ``berth-sandbox``), so the default (one pool of 2) holds
about 700 MB, and a pool used once stays warm until the service stops (on
overlay2 a container costs next to nothing). The pool stays off when
``docker/pool/`` and ``sandboxes/`` are on different filesystems, because a
claim's rename cannot cross them. A pool container is started by the same
code as a sandbox's, without env or labels, in
``<data_dir>/docker/pool/<slot>/``, named ``berth-<installation>.pool-<slot>``
(``.`` never occurs in a sandbox ID) and labelled ``berth.pool=<slot>``
instead of ``berth.sandbox_id``.

``create`` claims the oldest ready one of its size (taken without an
await, so two creates never share one): the slot directory is renamed to
the sandbox's (a bind mount, like the loop mount inside it, holds the
directory, not its path, so the running container keeps its workspace and
socket and the host's mount follows the rename; ``docker inspect`` keeps
showing the slot path, which matters only to a ``docker start`` of an
exited container, which Berth never does), ``pool-claim.json`` records the
sandbox ID, its labels and network, then at once the container is renamed
to ``berth-<installation>-<sandbox_id>``, sandboxd re-reads ``env.json``,
rewritten with the spec's variables (``env.reload``; its answer also proves
the container alive) and an ``enabled`` sandbox gets its network. A pool
container that fails any step, or mounts an outdated sandboxd or CA bundle,
is removed and the next one (or a fresh container) is used. The user sees
no difference from a fresh container: the same env, limits, empty
``/workspace``, hostname, mounts and network; only the uid differs.

Labels cannot change, so a claimed container keeps ``berth.pool`` and
``berth.network=disabled``, and lacks the sandbox's labels: its handle takes
them from ``pool-claim.json`` (kept in the sandbox directory, outside the
container's mounts, so the sandbox cannot rewrite it), and ``adopt`` takes a
pool container as a sandbox only when its name and that record agree.
``close()`` removes the unclaimed pool containers (after a fill in progress
ends); whatever a crash leaves, the next ``adopt`` removes, so no container
pooled under an earlier configuration (image, sandboxd) is ever claimed,
and exactly one service process should use a data dir.
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
import stat
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
    SandboxBackend,
    SandboxGone,
    SandboxSpec,
    SandboxStartError,
    egress_env,
    proxy_env,
)
from services.sandbox.backends._warm_pool import WarmPool
from services.sandbox.daemon import bundle
from services.sandbox.daemon_client import DaemonClient, DaemonError, DaemonUnavailable, probe
from services.sandbox.isolation.identity import host_uid
from services.sandbox.isolation.network import (
    SLIRP_DNS,
    NetworkSetupError,
    UserNetwork,
    apply_filter,
    filter_ruleset,
    host_addresses,
    parse_cidrs,
    prepare_user_network,
    start_user_network,
)
from services.sandbox.isolation.quota import IMAGE_NAME, QuotaError, mount_workspace, sync_filesystem, unmount_under
from services.sandbox.isolation.sizes import DEFAULT_SIZE, SIZES, ContainerSize

__all__ = ["DockerBackend", "installation_id"]

log = structlog.stdlib.get_logger(__name__)

_SANDBOX_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
_DAEMON_IN_SANDBOX = "/opt/berth/sandboxd.pyz"
_CA_IN_SANDBOX = "/opt/berth/ca-certificates.crt"
_RUN_IN_SANDBOX = "/run/berth"
_WORKSPACE_IN_SANDBOX = "/workspace"
# Tools that do not read the system store, or read one that lacks a host
# proxy's CA, each have their own variable.
_CA_ENV = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", "PIP_CERT", "GIT_SSL_CAINFO")
_LIVE_STATES = ("running", "paused")
_OOM_SCORE_ADJ = 500
# What an enabled sandbox's network needs on the service's host.
_NETWORK_TOOLS = ("slirp4netns", "nft", "nsenter", "ip")
_TUN_DEVICE = Path("/dev/net/tun")
_POLL_S = 0.01
_INSPECT_S = 0.25
_MANAGED = "berth.managed"
_INSTALLATION = "berth.installation"
_SANDBOX_LABEL = "berth.sandbox_id"
_NETWORK_LABEL = "berth.network"
_SIZE_LABEL = "berth.size"
_POOL_LABEL = "berth.pool"
# Labels every container of the installation carries, not the sandbox's own.
_INTERNAL_LABELS = (_MANAGED, _INSTALLATION, _NETWORK_LABEL, _SIZE_LABEL, _POOL_LABEL, "berth.data_dir")
_CLAIM_FILE = "pool-claim.json"
_USER_NETWORK_FILE = "user-network.json"
# A claim that fails here discards the pool container and tries the next one.
_CLAIM_ERRORS = (BackendError, DaemonError, DaemonUnavailable, OSError, ValueError, docker.errors.DockerException)

_T = TypeVar("_T")


def installation_id(data_dir: Path) -> str:
    """Identifies one data dir, hence one installation, on a shared engine."""
    return hashlib.sha256(str(Path(data_dir).resolve()).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class _Paths:
    home: Path

    @property
    def workspace(self) -> Path:
        return self.home / "workspace"

    @property
    def image(self) -> Path:
        return self.home / IMAGE_NAME

    @property
    def run(self) -> Path:
        return self.home / "run"

    @property
    def socket(self) -> Path:
        return self.run / "sandboxd.sock"

    @property
    def user_network(self) -> Path:
        return self.home / _USER_NETWORK_FILE

    @property
    def slirp_log(self) -> Path:
        return self.home / "slirp4netns.log"


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


def _pool_key(spec: SandboxSpec) -> ContainerSize:
    """The warm pool serving ``spec``: one per size, whatever the network
    policy (every container is created without network)."""
    return spec.size


def _mount_sources(container: Container) -> dict[str, str]:
    """Bind mount target -> host source, as the container was created."""
    mounts = container.attrs.get("HostConfig", {}).get("Mounts") or []
    return {str(m.get("Target")): str(m.get("Source")) for m in mounts}


def _user_of(container: Container) -> tuple[int, int]:
    """The host uid and gid the container runs as (``uid:gid``; 0 for a
    container made before sandboxes had their own)."""
    user = str((container.attrs.get("Config") or {}).get("User") or "")
    uid, _, gid = user.partition(":")
    try:
        return int(uid), int(gid or uid)
    except ValueError:
        return 0, 0


def _write_private(path: Path, text: str, owner: tuple[int, int] | None = None) -> None:
    """Replaces ``path`` at once (a reader never sees half a file), mode
    0600, owned by ``owner`` when given. The temporary file is new
    (``O_EXCL``, random name): in a directory the sandbox can write to, a
    link planted there is never followed, and the rename replaces a link at
    ``path`` rather than writing through it."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as handle:
            if owner is not None:
                os.fchown(handle.fileno(), *owner)
            handle.write(text)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    """Gives ``root`` and everything below it to ``uid``:``gid``, never
    following a link (a sandbox may have planted one to a host file)."""
    os.chown(root, uid, gid, follow_symlinks=False)
    for parent, dirs, files in os.walk(root, followlinks=False):
        for name in (*dirs, *files):
            os.chown(os.path.join(parent, name), uid, gid, follow_symlinks=False)


def _copy_regular(source: str, target: str) -> None:
    if stat.S_ISREG(os.lstat(source).st_mode):
        shutil.copy2(source, target)


def _read_user_network(path: Path) -> UserNetwork | None:
    try:
        return UserNetwork.from_private(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def _in_container(pid: int, container_id: str) -> bool:
    """Whether ``pid``, in this process's PID namespace, is a process of the
    container: its cgroup path names the container's ID on every cgroup
    driver and version. False when the service does not see the engine's
    PIDs (another PID namespace) or the process is gone."""
    try:
        return container_id in Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False


def _mounted_device(pid: int, mount_point: str) -> str | None:
    """``major:minor`` of the filesystem on top at ``mount_point`` in the
    mount namespace of ``pid``."""
    found: str | None = None
    with open(f"/proc/{pid}/mountinfo") as mountinfo:
        for line in mountinfo:
            fields = line.split()
            if len(fields) > 4 and fields[4] == mount_point:
                found = fields[2]
    return found


def _require_user_network() -> None:
    """Fails unless this host can give a sandbox its own network."""
    missing = [tool for tool in _NETWORK_TOOLS if shutil.which(tool) is None]
    if not _TUN_DEVICE.exists():
        missing.append(str(_TUN_DEVICE))
    if missing:
        raise BackendUnavailable(
            f"a sandbox with network enabled needs {', '.join(missing)} on the Sandbox service's host "
            "(apt-get install slirp4netns nftables util-linux iproute2)"
        )


def _proxy_env(settings: Settings) -> dict[str, str]:
    return proxy_env(settings.sandbox_http_proxy, settings.sandbox_https_proxy, settings.sandbox_no_proxy)


_CopyKey = tuple[str, int, int, str]


def _copy_by_content(source: Path, target_dir: Path, stem: str, suffix: str, copies: dict[_CopyKey, Path]) -> Path:
    """Copies ``source`` to a read-only file named by its content hash;
    an existing copy is reused as it is (and never rewritten under a
    container that has it mounted). ``copies`` remembers the copy made for
    an unchanged source, so it is not read and hashed again."""
    info = source.stat()
    key = (str(source), info.st_size, info.st_mtime_ns, str(target_dir))
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
        self._install = str(self._data_dir)
        self._image = settings.docker_image
        self._allow = parse_cidrs(settings.sandbox_allow_cidrs)
        self._start_timeout_s = settings.docker_start_timeout_s
        self._installation = installation_id(self._data_dir)
        self._client = client
        self._client_lock = asyncio.Lock()
        self._engine_cpus: int | None = None
        self._locks: dict[str, asyncio.Lock] = {}
        self._copies: dict[_CopyKey, Path] = {}
        self._pool: WarmPool[ContainerSize, _PoolEntry] = WarmPool(
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
        if spec.network == "enabled":
            # Before any container is made or claimed for it.
            _require_user_network()
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
                await self._stop_user_network(self._paths(spec.sandbox_id))
                if pooled:
                    (self._paths(spec.sandbox_id).home / _CLAIM_FILE).unlink(missing_ok=True)
            try:
                handle = await self._create_from_pool(spec)
                return handle if handle is not None else await self._start(spec)
            finally:
                # After the create, not competing with it: a size in use is
                # kept warm from now on, whether it was pre-filled or not.
                self._pool.refill(_pool_key(spec))

    async def pause(self, handle: BackendHandle) -> None:
        async with self._lock(handle.sandbox_id):
            container = await self._live_container(handle)
            if container.status == "paused":
                return
            # Written files reach the disk before the processes that wrote them
            # freeze: the workspace's filesystem, not every one of the host's.
            await asyncio.to_thread(sync_filesystem, Path(str(handle.private["workspace_dir"])))
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
            paths = self._paths(handle.sandbox_id)
            await self._stop_user_network(paths)
            await self._remove_tree(paths.home)
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
                # Nothing is mounted in a directory that is gone.
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
        """Enables the warm pools and starts filling those of
        ``docker_pool_sizes`` (``docker_pool_size`` containers each); every
        other size starts filling after its first create."""
        await prepare_user_network(self._data_dir / "docker")
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
        self._pool.start([SIZES[name] for name in dict.fromkeys(self._settings.docker_pool_sizes)])

    async def close(self) -> None:
        """Removes the warm pool's unclaimed containers and slot directories
        (after letting a fill in progress finish); sandboxes keep running."""
        await self._pool.close()

    @property
    def pool_size(self) -> int:
        """Pool containers kept ready per ``container_size`` in use."""
        return self._pool.size

    def warm_count(self, size: ContainerSize = DEFAULT_SIZE) -> int:
        """Pool containers ready to be claimed by a sandbox of ``size``."""
        return self._pool.ready(size)

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

    # ------------------------------------------------------------ naming

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    def _paths(self, sandbox_id: str) -> _Paths:
        return _Paths(self._data_dir / "sandboxes" / sandbox_id)

    def _container_name(self, sandbox_id: str) -> str:
        return f"berth-{self._installation}-{sandbox_id}"

    def _slot_paths(self, slot: str) -> _Paths:
        return _Paths(self._data_dir / "docker" / "pool" / slot)

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
        uid, gid = _user_of(container)
        private: dict[str, Any] = {
            "container_id": container.id,
            "container_name": name,
            "image": str(container.attrs.get("Config", {}).get("Image", self._image)),
            "installation": self._installation,
            "network": labels.get(_NETWORK_LABEL, "disabled"),
            "size": labels.get(_SIZE_LABEL, ""),
            "uid": uid,
            "gid": gid,
            "home": str(paths.home),
            "workspace_dir": str(paths.workspace),
            "run_dir": str(paths.run),
            "labels": {k: v for k, v in labels.items() if k not in _INTERNAL_LABELS},
        }
        if private["network"] == "enabled":
            user_network = _read_user_network(paths.user_network)
            if user_network is not None:
                private["user_network"] = user_network.to_private()
        return BackendHandle(sandbox_id=sandbox_id, socket_path=str(paths.socket), private=private)

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

    async def _cpu_limit(self, client: docker.DockerClient, cpu_millis: int) -> int:
        if self._engine_cpus is None:
            info = await self._call(client.info)
            self._engine_cpus = max(1, int(info.get("NCPU") or 1))
        # The engine refuses a limit above its CPU count.
        return min(cpu_millis, self._engine_cpus * 1000) * 1_000_000

    # ------------------------------------------------------------ starting

    async def _start(self, spec: SandboxSpec, *, pool_slot: str | None = None) -> BackendHandle:
        """Starts a fresh container for ``spec``. With ``pool_slot`` it is a
        warm pool container instead: in the slot's directory, under the
        slot's name and uid, labelled as a pool container rather than a sandbox."""
        client = await self._docker()
        try:
            await self._call(lambda: client.images.get(self._image))
        except docker.errors.NotFound:
            raise BackendUnavailable(
                f"sandbox image {self._image} is not on the Docker engine: build it (deploy/images/build-base.sh) "
                "or pull it on every sandbox node, or set BERTH_DOCKER_IMAGE"
            ) from None

        paths = self._paths(spec.sandbox_id) if pool_slot is None else self._slot_paths(pool_slot)
        size = spec.size
        uid, gid = await self._mount_workspace(paths, size, host_uid(self._install, spec.sandbox_id))

        def prepare() -> tuple[Path, Path | None]:
            daemon_file, ca_file = self._shared_files()
            paths.run.mkdir(mode=0o700, parents=True, exist_ok=True)
            # What a container of the sandbox left here may be hostile: no
            # link in it is followed.
            if os.stat(paths.run, follow_symlinks=False).st_uid != uid:
                _chown_tree(paths.run, uid, gid)
            state = paths.run / "state"
            if state.is_symlink():
                state.unlink()
            state.mkdir(mode=0o700, exist_ok=True)
            os.chown(state, uid, gid, follow_symlinks=False)
            with contextlib.suppress(FileNotFoundError):
                paths.socket.unlink()
            env = self._sandbox_env(spec, ca_file is not None)
            _write_private(paths.run / "env.json", json.dumps(env), (uid, gid))
            return daemon_file, ca_file

        daemon_file, ca_file = await asyncio.to_thread(prepare)
        mounts = [
            Mount(_WORKSPACE_IN_SANDBOX, str(paths.workspace), type="bind"),
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
            _NETWORK_LABEL: spec.network,
            _SIZE_LABEL: size.name,
            "berth.data_dir": str(self._data_dir),
        }
        if pool_slot is not None:
            # Labels cannot change later: a claim is recorded in the
            # sandbox's directory instead (see _Claim).
            del labels[_SANDBOX_LABEL]
            labels[_POOL_LABEL] = pool_slot
        nano_cpus = await self._cpu_limit(client, size.cpu_millis)

        name = self._container_name(spec.sandbox_id) if pool_slot is None else self._pool_container_name(pool_slot)
        container: Container = await self._call(
            lambda: client.containers.run(
                self._image,
                entrypoint=["python3", _DAEMON_IN_SANDBOX],
                command=[
                    "--socket", f"{_RUN_IN_SANDBOX}/sandboxd.sock",
                    "--workspace", _WORKSPACE_IN_SANDBOX,
                    "--state-dir", f"{_RUN_IN_SANDBOX}/state",
                    "--isolation", "docker",
                    "--env-file", f"{_RUN_IN_SANDBOX}/env.json",
                ],  # fmt: skip
                name=name,
                hostname="sandbox",
                working_dir=_WORKSPACE_IN_SANDBOX,
                detach=True,
                labels=labels,
                mounts=mounts,
                user=f"{uid}:{gid}",
                environment={"HOME": _WORKSPACE_IN_SANDBOX},
                cap_drop=["ALL"],
                security_opt=["no-new-privileges:true"],
                read_only=True,
                tmpfs={
                    "/tmp": f"rw,exec,nosuid,nodev,size={size.tmp_mib}m",
                    # sandboxd's process logs: bounded and charged to the
                    # container's memory, never to the host's disk outside the quota.
                    f"{_RUN_IN_SANDBOX}/state": f"rw,noexec,nosuid,nodev,size={size.tmp_mib}m,uid={uid},gid={gid},mode=0700",
                },
                ipc_mode="private",
                oom_score_adj=_OOM_SCORE_ADJ,
                network_mode="none",
                dns=[SLIRP_DNS],
                pids_limit=size.pids,
                mem_limit=f"{size.memory_mib}m",
                memswap_limit=f"{size.memory_mib}m",
                nano_cpus=nano_cpus,
                log_config={"type": "json-file", "config": {"max-size": "1m", "max-file": "1"}},
            )
        )
        try:
            # run() returns the container as inspected before it started.
            await self._call(container.reload)
            pid = await self._container_pid(container)
            await self._check_workspace_mount(container, pid, paths)
            # Readiness comes from the daemon, not the engine.
            await self._wait_ready(str(paths.socket), spec.sandbox_id, container)
            if spec.network == "enabled":
                await self._attach_user_network(container, paths)
        except BaseException:
            with contextlib.suppress(BackendError, docker.errors.DockerException):
                await self._remove_container(container)
            with contextlib.suppress(OSError):
                await self._stop_user_network(paths)
            raise
        log.info(
            "sandbox_started" if pool_slot is None else "pool_container_started",
            sandbox_id=spec.sandbox_id,
            backend="docker",
            container=name,
            network=spec.network,
            size=size.name,
            image=self._image,
        )
        return self._handle_for(container)

    async def _mount_workspace(self, paths: _Paths, size: ContainerSize, uid: int) -> tuple[int, int]:
        """Mounts the sandbox's workspace filesystem (made at ``size`` and
        owned by ``uid`` when it is new) and returns the uid and gid that
        own it: a sandbox made again keeps the identity its files have."""
        # The image and the logs in it are the sandbox's alone.
        await asyncio.to_thread(paths.home.mkdir, 0o700, True, True)
        await asyncio.to_thread(self._migrate_plain_workspace, paths)
        try:
            await mount_workspace(paths.image, paths.workspace, size_mib=size.disk_mib, uid=uid, gid=uid)
            if paths.home.joinpath("workspace.plain").is_dir():
                await asyncio.to_thread(self._copy_plain_workspace, paths)
        except QuotaError as exc:
            raise BackendUnavailable(f"the workspace disk quota cannot be applied: {exc}") from exc
        owner = await asyncio.to_thread(os.stat, paths.workspace)
        return owner.st_uid, owner.st_gid

    @staticmethod
    def _migrate_plain_workspace(paths: _Paths) -> None:
        """A workspace made before the disk quota is a plain directory with
        files and no image: it is set aside, to be copied into the new
        filesystem (``_copy_plain_workspace``) instead of hidden under it."""
        if paths.image.exists() or os.path.ismount(paths.workspace) or not paths.workspace.is_dir():
            return
        if any(paths.workspace.iterdir()):
            os.rename(paths.workspace, paths.home / "workspace.plain")

    @staticmethod
    def _copy_plain_workspace(paths: _Paths) -> None:
        plain = paths.home / "workspace.plain"
        owner = os.stat(paths.workspace)
        # Links are copied as links, and only regular files are copied: a
        # FIFO the sandbox left would block the copy.
        shutil.copytree(plain, paths.workspace, symlinks=True, dirs_exist_ok=True, copy_function=_copy_regular)
        _chown_tree(paths.workspace, owner.st_uid, owner.st_gid)
        shutil.rmtree(plain)

    async def _container_pid(self, container: Container) -> int:
        """The host pid of the container's first process, checked to be the
        container's in this process's PID namespace."""
        pid = int((container.attrs.get("State") or {}).get("Pid") or 0)
        if container.status != "running" or pid <= 0:
            raise SandboxStartError(
                f"container {container.name} is {container.status} while starting: {await self._log_tail(container)}"
            )
        if not await asyncio.to_thread(_in_container, pid, str(container.id)):
            raise BackendUnavailable(
                f"the Sandbox service does not see the processes of container {container.name} (pid {pid}): it must "
                "run on the Docker engine's host in its PID namespace (a container of it needs --pid=host)"
            )
        return pid

    async def _check_workspace_mount(self, container: Container, pid: int, paths: _Paths) -> None:
        """Fails unless the container's ``/workspace`` is the quota'd
        filesystem the service mounted: an engine in another mount namespace
        would bind the empty directory under it, without any quota."""
        try:
            want = await asyncio.to_thread(os.stat, paths.workspace)
            seen = await asyncio.to_thread(_mounted_device, pid, _WORKSPACE_IN_SANDBOX)
        except OSError as exc:
            raise SandboxStartError(f"cannot inspect the mounts of container {container.name}: {exc}") from exc
        if seen != f"{os.major(want.st_dev)}:{os.minor(want.st_dev)}":
            raise BackendUnavailable(
                f"container {container.name} does not see the workspace filesystem mounted at {paths.workspace}: "
                "the Docker engine must share the Sandbox service's mounts (run the service in the host's mount "
                "namespace, or bind the data dir with rshared propagation)"
            )

    async def _attach_user_network(self, container: Container, paths: _Paths) -> None:
        """Gives the running container of an ``enabled`` sandbox its network:
        the egress filter first, then slirp4netns (``isolation/network.py``),
        recorded in ``user-network.json`` for ``destroy``."""
        pid = await self._container_pid(container)
        netns = Path(f"/proc/{pid}/ns/net")
        try:
            addresses = await asyncio.to_thread(host_addresses)
            await apply_filter(netns, filter_ruleset(self._allow, addresses))
            user_network = await start_user_network(netns, paths.slirp_log)
        except NetworkSetupError as exc:
            raise SandboxStartError(f"the network of container {container.name} could not be set up: {exc}") from exc
        try:
            await asyncio.to_thread(_write_private, paths.user_network, json.dumps(user_network.to_private()))
            # The pid was the container's before and after: so it was all along.
            if not await asyncio.to_thread(_in_container, pid, str(container.id)):
                raise SandboxStartError(f"container {container.name} ended while its network was set up")
        except BaseException:
            await asyncio.to_thread(user_network.stop)
            raise

    async def _stop_user_network(self, paths: _Paths) -> None:
        user_network = await asyncio.to_thread(_read_user_network, paths.user_network)
        if user_network is not None:
            await asyncio.to_thread(user_network.stop)
        await asyncio.to_thread(paths.user_network.unlink, True)

    async def _wait_ready(self, socket_path: str, sandbox_id: str, container: Container) -> None:
        """Waits for sandboxd to answer on its socket. The socket file is
        checked often (cheap); the engine is asked whether the container
        died only every ``_INSPECT_S``, as each inspect is an API round trip."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._start_timeout_s
        next_inspect = loop.time() + _INSPECT_S
        last_error: Exception | None = None
        while loop.time() < deadline:
            last_error = await probe(socket_path)
            if last_error is None:
                return
            if loop.time() >= next_inspect:
                await self._call(container.reload)
                if container.status not in ("created", "running"):
                    raise SandboxStartError(
                        f"sandbox {sandbox_id} container is {container.status} while starting: "
                        f"{await self._log_tail(container)}"
                    )
                next_inspect = loop.time() + _INSPECT_S
            await asyncio.sleep(_POLL_S)
        raise SandboxStartError(
            f"sandbox daemon {sandbox_id} not ready after {self._start_timeout_s}s "
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
        daemon = bundle.build(shared)
        ca = None if ca_source is None else _copy_by_content(ca_source, shared, "ca-bundle", ".crt", self._copies)
        return daemon, ca

    async def _make_pool_container(self, size: ContainerSize) -> _PoolEntry:
        # Asks the engine its CPU count now rather than during a claim.
        await self._cpu_limit(await self._docker(), 1)
        slot = secrets.token_hex(6)
        self._pool_slots.add(slot)
        try:
            handle = await self._start(SandboxSpec(sandbox_id=slot, network="disabled", size=size), pool_slot=slot)
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
        while (entry := self._pool.take(_pool_key(spec))) is not None:
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
        the slot path), and the workspace filesystem mounted inside moves
        along. Then, at once: the container gets the sandbox's name,
        sandboxd re-reads env.json, now the sandbox's (its answer also proves
        the container alive), and an ``enabled`` sandbox gets its network.
        On any failure the container and the directory are removed."""
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
            claim = _Claim(
                sandbox_id=spec.sandbox_id,
                container_id=container_id,
                labels={**{str(k): str(v) for k, v in spec.labels.items()}, _SANDBOX_LABEL: spec.sandbox_id},
                network=spec.network,
            )
            env = json.dumps(self._sandbox_env(spec, ca_file is not None))
            owner = _user_of(container)

            def move_in() -> None:
                nonlocal moved
                paths.home.parent.mkdir(parents=True, exist_ok=True)
                os.rename(slot_home, paths.home)
                moved = True
                # Before the rename of the container: adopt takes a container
                # named as a sandbox only with its claim record.
                _write_private(paths.home / _CLAIM_FILE, claim.to_json())
                _write_private(paths.run / "env.json", env, owner)

            await asyncio.to_thread(move_in)
            name = self._container_name(spec.sandbox_id)
            steps: list[Awaitable[object]] = [
                self._call(lambda: client.api.rename(container_id, name)),
                self._reload_env(paths.socket),
            ]
            if spec.network == "enabled":
                steps.append(self._attach_user_network(container, paths))
            for result in await asyncio.gather(*steps, return_exceptions=True):
                if isinstance(result, BaseException):
                    raise result
        except BaseException:
            with contextlib.suppress(*_CLAIM_ERRORS):
                await self._discard_slot(entry.slot, container)
            if moved:
                with contextlib.suppress(*_CLAIM_ERRORS):
                    await self._stop_user_network(paths)
                    await self._remove_tree(paths.home)
            raise
        log.info(
            "sandbox_started",
            sandbox_id=spec.sandbox_id,
            backend="docker",
            container=name,
            network=spec.network,
            size=spec.size.name,
            image=self._image,
            pool_slot=entry.slot,
        )
        return self._handle_for(container, claim)

    async def _reload_env(self, socket: Path) -> None:
        daemon = DaemonClient(str(socket), connect_timeout_s=2.0, request_timeout_s=5.0)
        try:
            await daemon.reload_env()
        finally:
            await daemon.close()

    # ------------------------------------------------------------ deleting

    async def _remove_tree(self, home: Path) -> None:
        """Deletes a sandbox's (or slot's) directory, unmounting its
        workspace filesystem first: the deletion never reaches into a
        mounted filesystem, and the loop device is released."""
        try:
            await unmount_under(home)
        except QuotaError as exc:
            raise BackendError(f"could not unmount the filesystems under {home}: {exc}") from exc
        await asyncio.to_thread(shutil.rmtree, home, True)
        if home.exists():
            raise BackendError(f"could not delete {home}")
