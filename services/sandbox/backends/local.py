"""The ``local`` backend: sandboxd under bubblewrap on this host, confined.

Layout of one sandbox::

    <data_dir>/sandboxes/<sandbox_id>/          root-owned, 0700
        workspace.ext4    the workspace filesystem (sparse image, the disk quota)
        workspace/        its mount point, bound read-write at /workspace
        run/              host only: handle.json, bwrap.pid, sandbox.log, slirp.log
        run/berth/        owned by the sandbox's uid, bound at /run/berth:
                          sandboxd.sock, env.json, egress.sock (restricted); its
                          state/ (process logs) is a sized tmpfs inside the sandbox
    <data_dir>/isolation/                       shared by every sandbox, read-only to them
        etc-<hash>/       the minimal /etc (``isolation/etc.py``)
        sandboxd-<hash>.pyz, seccomp-<hash>.bpf  (the daemon's zipapp: ``daemon/bundle.py``)

Host-side bookkeeping stays out of the mounted directory so nothing inside the
sandbox can make the service signal an arbitrary host pid.

What confines a sandbox (isolation ``bwrap``, the default; every piece is
required, and a create that cannot apply one fails with BackendUnavailable
naming it):

* **Identity.** bubblewrap runs as the sandbox's own unprivileged host uid
  (``isolation/identity.py``) in a new user namespace, where it is uid 1000
  (``sandbox``). It never runs as host root, and no two sandboxes share a
  host uid. Its mount sources are handed over as file descriptors, so the
  unprivileged uid needs no access to the host directories above.
* **Namespaces.** user, mount, PID, IPC, UTS, cgroup and network are all
  new; no capability is kept, and no user namespace can be made inside.
* **Files.** ``/usr`` (and the ``/bin``, ``/lib`` links) read-only, a
  minimal generated ``/etc``, private ``/proc``, ``/dev`` and a sized
  ``/tmp``, the workspace and ``/run/berth``. Nothing else of the host.
* **Syscalls.** the seccomp filter of ``isolation/seccomp.py``.
* **Limits.** memory (with swap), pids and CPU in the sandbox's own cgroup
  (``isolation/cgroups.py``), and the workspace quota (``isolation/quota.py``),
  all from the spec's ``container_size``.
* **Network.** always its own namespace: ``disabled`` and ``restricted`` keep
  only loopback (``restricted`` reaches its egress proxy through sandboxd's
  relay); ``enabled`` gets slirp4netns behind the egress filter of
  ``isolation/network.py``.

bwrap is started in its own session and without ``--die-with-parent``, so a
sandbox outlives a restart of the Sandbox service; ``adopt`` finds it again
through ``handle.json``. The daemon is the sandbox's PID 1 (``--as-pid-1``):
when it exits the kernel kills everything left in the sandbox.

An idle daemon goes dormant after ``dormant_after_s`` (``sandboxd/dormant.py``):
the sandbox keeps its PID 1, socket and connections at a fraction of the
memory, and the next request wakes it.

Warm pool
---------
With ``pool_size`` > 0 the backend keeps that many sandboxes started per
key (container size, network policy), under ``<data_dir>/pool/<slot>/``,
laid out as above: bubblewrap, cgroups, workspace quota, namespaces and the
``enabled`` network's slirp4netns and filter are all in place, and so the
sandbox's uid (from its slot). ``create`` of a new sandbox takes the oldest
ready one of its key (without an await, so no two creates share one),
renames its directory to the sandbox's (the bind and loop mounts hold the
directories, not their paths, so the running sandbox keeps them), rewrites
``env.json`` with the spec's variables and has sandboxd re-read it and take
up the idle period. Nothing ever ran in a pooled sandbox and it is claimed
once, so a claimant sees nothing of anyone else. A key fills after its first
create and is topped up after each one, one sandbox at a time; ``close()``
destroys the unclaimed ones and ``start()`` what an earlier process left.
A pooled daemon never goes dormant before its claim, so a claim never waits
for one to wake. Isolation ``none`` has no pool.

Pause freezes the sandbox's cgroup (cgroup v2 ``cgroup.freeze`` or the cgroup
v1 freezer). Isolation ``none`` (development only, set explicitly) runs the
daemon unconfined on the host's network as the service's user, freezes with
SIGSTOP/SIGCONT, and applies no limit.
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
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

import structlog

from services.sandbox.backends._warm_pool import WarmPool
from services.sandbox.backends.base import (
    BackendError,
    BackendHandle,
    BackendUnavailable,
    SandboxBackend,
    SandboxGone,
    SandboxSpec,
    SandboxStartError,
    NetworkPolicy,
    egress_env,
)
from services.sandbox.daemon import bundle
from services.sandbox.daemon.sandboxd.dormant import launch
from services.sandbox.daemon_client import DaemonClient, DaemonError, DaemonUnavailable, probe
from services.sandbox.isolation.cgroups import CgroupError, CgroupHost, SandboxCgroup, detect_cgroups
from services.sandbox.isolation.etc import build_etc
from services.sandbox.isolation.identity import SANDBOX_GID, SANDBOX_UID, host_uid
from services.sandbox.isolation.network import (
    NetworkSetupError,
    UserNetwork,
    apply_filter,
    filter_ruleset,
    host_addresses,
    parse_cidrs,
    prepare_user_network,
    start_user_network,
)
from services.sandbox.isolation.quota import (
    IMAGE_NAME,
    QuotaError,
    mount_workspace,
    sync_filesystem,
    unmount_under,
    unmount_workspace,
)
from services.sandbox.isolation.seccomp import SeccompUnavailable, write_filter
from services.sandbox.isolation.sizes import SIZES

__all__ = ["LocalBackend", "Isolation", "FreezerKind", "detect_freezers"]

Isolation = Literal["bwrap", "none"]
FreezerKind = Literal["cgroup_v2", "cgroup_v1", "signal"]

log = structlog.stdlib.get_logger(__name__)

_SANDBOX_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_DAEMON_IN_SANDBOX = "/opt/berth/sandboxd.pyz"
_RUN_IN_SANDBOX = "/run/berth"
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# bwrap and the daemon must not inherit the service's environment (API keys,
# database URLs); commands get only what the sandbox spec grants them.
_HOST_ENV = {"PATH": _PATH, "LANG": "C.UTF-8"}
# Run as root before bwrap: join every cgroup of the sandbox, failing the
# start if one cannot be joined, then (setpriv) drop to the sandbox's uid.
_JOIN = (
    'for f in $BERTH_CGROUPS; do echo $$ > "$f" || { echo "berth: cannot join cgroup $f" >&2; exit 97; }; done; '
    'exec "$@"'
)
_POLL_S = 0.01
_START_ATTEMPTS = 4
# Where the staging bwrap puts the mount sources (its own tmpfs, never the host's /tmp).
_STAGE = "/tmp/berth-stage"
# A warm pool sandbox: (container_size name, network policy). Both are fixed
# when bubblewrap starts (cgroup limits, /tmp, workspace image, namespace
# and its filter), so a claimant gets a pooled sandbox only of its own key.
_PoolKey = tuple[str, NetworkPolicy]
_POOL_DIR = "pool"


@dataclass(frozen=True)
class _ProcStat:
    pid: int
    ppid: int
    state: str
    start_time: int


def _proc_stat(pid: int) -> _ProcStat | None:
    try:
        data = Path(f"/proc/{pid}/stat").read_text(errors="replace")
    except OSError:
        return None
    # The command name may contain ")", so fields start after the last one.
    fields = data[data.rfind(")") + 2 :].split()
    return _ProcStat(pid=pid, ppid=int(fields[1]), state=fields[0], start_time=int(fields[19]))


def _children(pid: int) -> list[int]:
    """The children of every thread of ``pid`` (``/proc/<pid>/task/<tid>/children``)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found: list[int] = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as handle:
                found.extend(int(child) for child in handle.read().split())
        except OSError:
            continue
    return found


# Whether the kernel lists each task's children (CONFIG_PROC_CHILDREN); without
# it a tree is found by reading every process's stat.
_CHILDREN_LISTED = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


def _process_tree(root: int) -> list[int]:
    """``root`` and its live descendants, parents before children. It walks
    down from ``root``, so it costs the tree's size, not the host's process
    count (a sandbox start polls it while hundreds of sandboxes run)."""
    if not _CHILDREN_LISTED:
        return _scanned_tree(root)
    order, seen = [root], {root}
    for pid in order:
        for child in _children(pid):
            if child not in seen:
                seen.add(child)
                order.append(child)
    return [pid for pid in order if (stat := _proc_stat(pid)) is not None and stat.state not in ("Z", "X")]


def _scanned_tree(root: int) -> list[int]:
    """``_process_tree`` from a scan of every process's stat."""
    children: dict[int, list[int]] = {}
    states: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _proc_stat(int(entry))
            if stat is not None:
                children.setdefault(stat.ppid, []).append(stat.pid)
                states[stat.pid] = stat.state
    if root not in states:
        return []
    order = [root]
    for pid in order:
        order.extend(children.get(pid, ()))
    return [pid for pid in order if states.get(pid) not in ("Z", "X")]


_MAX_INFO_BYTES = 4096


async def _read_info(fd: int) -> object | None:
    """The JSON object bubblewrap writes on its ``--info-fd`` (non-blocking
    ``fd``), read as it arrives: bwrap writes it in parts and keeps the pipe
    open, so the object ends where it first parses. None when the pipe
    closes first (bwrap failed before the sandbox existed)."""
    loop = asyncio.get_running_loop()
    readable = asyncio.Event()
    loop.add_reader(fd, readable.set)
    buffer = b""
    try:
        while len(buffer) <= _MAX_INFO_BYTES:
            await readable.wait()
            readable.clear()
            try:
                chunk = os.read(fd, _MAX_INFO_BYTES)
            except BlockingIOError:
                continue
            if not chunk:
                return None
            buffer += chunk
            with contextlib.suppress(ValueError):
                info: object = json.loads(buffer)
                return info
        return None
    finally:
        loop.remove_reader(fd)


def _host_tops() -> list[str]:
    """bwrap arguments that bind (read-only) or recreate as symlinks the
    host's top-level program and library directories."""
    argv = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    return argv


def _staging_root() -> list[str]:
    """The staging bwrap's root: what ``setpriv`` and the sandbox's bwrap
    run with (programs, libraries, ``/etc``, the host's ``/proc``, whose
    full view the sandbox's own proc mount requires, and ``/dev``)."""
    return [*_host_tops(), "--ro-bind", "/etc", "/etc", "--bind", "/proc", "/proc", "--dev-bind", "/dev", "/dev"]


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _stop_user_network(handle: BackendHandle) -> None:
    user_network = UserNetwork.from_private(handle.private.get("user_network"))
    if user_network is not None:
        user_network.stop()


def _pool_key(spec: SandboxSpec) -> _PoolKey:
    return (spec.size.name, spec.network)


def detect_freezers() -> list[FreezerKind]:
    """Freezers usable on this host, best first."""
    try:
        host = detect_cgroups()
    except CgroupError:
        return ["signal"]
    return ["cgroup_v2" if host.version == "v2" else "cgroup_v1", "signal"]


_CA_IN_SANDBOX = "/etc/ssl/certs/ca-certificates.crt"
_CA_ENV = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", "PIP_CERT", "GIT_SSL_CAINFO")
_RESERVED_TARGETS = ("/", "/proc", "/dev", "/etc", "/tmp", "/workspace", _RUN_IN_SANDBOX, _DAEMON_IN_SANDBOX)


def _check_mounts(mounts: Mapping[str | Path, str]) -> list[tuple[str, str]]:
    checked: list[tuple[str, str]] = []
    for host, target in mounts.items():
        source = Path(host).resolve()
        normal = os.path.normpath(target)
        if not os.path.isabs(target) or normal in _RESERVED_TARGETS or any(normal.startswith(r + "/") for r in _RESERVED_TARGETS[1:]):
            raise ValueError(f"extra read-only mount target {target!r} must be an absolute path outside the sandbox's own mounts")
        if not source.exists():
            raise ValueError(f"extra read-only mount source {host} does not exist")
        checked.append((str(source), normal))
    return checked


@dataclass(frozen=True)
class _Paths:
    home: Path
    workspace: Path
    run: Path
    mounted: Path

    @property
    def socket(self) -> Path:
        return self.mounted / "sandboxd.sock"

    @property
    def handle_file(self) -> Path:
        return self.run / "handle.json"

    @property
    def image(self) -> Path:
        return self.home / IMAGE_NAME


@dataclass(frozen=True)
class _Assets:
    """What every confined sandbox of this backend shares, made once."""

    etc: Path
    daemon: Path
    seccomp: Path
    cgroups: CgroupHost


def _copy_by_content(source: Path, directory: Path, stem: str, suffix: str) -> Path:
    data = source.read_bytes()
    target = directory / f"{stem}-{hashlib.sha256(data).hexdigest()[:16]}{suffix}"
    if not target.exists():
        tmp = target.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.chmod(0o644)
        tmp.replace(target)
    return target


class LocalBackend(SandboxBackend):
    name = "local"

    def __init__(
        self,
        data_dir: Path,
        isolation: Isolation = "bwrap",
        extra_env: Mapping[str, str] | None = None,
        *,
        freezer: FreezerKind | Literal["auto"] = "auto",
        python: str | None = None,
        start_timeout_s: float = 15.0,
        extra_ro_mounts: Mapping[str | Path, str] | None = None,
        allow_cidrs: Sequence[str] = (),
        ca_bundle: Path | None = None,
        dormant_after_s: float = 0.0,
        pool_size: int = 0,
    ) -> None:
        """``python`` is the interpreter that runs sandboxd: ``python3`` from
        the sandbox's PATH under bubblewrap, this interpreter when unconfined.
        ``extra_ro_mounts`` maps host paths to absolute sandbox paths that
        bubblewrap binds read-only (e.g. a Python site-packages for MCP
        servers); unconfined sandboxes see the host's paths and ignore it.
        ``allow_cidrs`` are destinations an ``enabled`` sandbox may reach
        despite the private-range rule; ``ca_bundle`` becomes the sandbox's
        ``/etc/ssl/certs/ca-certificates.crt`` (default: the host's).
        ``dormant_after_s`` > 0 lets an idle daemon go dormant
        (``sandboxd/dormant.py``). ``pool_size`` sandboxes per key are kept
        started ahead (confined isolation only; see "Warm pool")."""
        self._data_dir = Path(data_dir).resolve()
        self._isolation: Isolation = isolation
        self._extra_env = dict(extra_env or {})
        self._freezer_choice = freezer
        self._python = python or ("python3" if isolation == "bwrap" else sys.executable)
        self._start_timeout_s = start_timeout_s
        self._extra_ro_mounts = _check_mounts(extra_ro_mounts or {})
        self._allow = parse_cidrs(allow_cidrs)
        self._ca_bundle = ca_bundle if ca_bundle is not None else Path("/etc/ssl/certs/ca-certificates.crt")
        self._dormant_after_s = dormant_after_s
        self._pool: WarmPool[_PoolKey, BackendHandle] = WarmPool(
            pool_size if isolation == "bwrap" else 0, self._make_pooled, self._discard_pooled, name="local-pool"
        )
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._assets: _Assets | None = None
        self._install = str(self._data_dir)
        # Sandbox cgroups of different data dirs (tests, several installs)
        # must not collide on one host.
        self._cgroup_prefix = hashlib.sha256(self._install.encode()).hexdigest()[:8]
        if isolation == "none":
            log.warning("sandbox_isolation_disabled", data_dir=str(self._data_dir))

    # ------------------------------------------------------------ public interface

    def socket_path(self, handle: BackendHandle) -> str:
        return handle.socket_path

    async def create(self, spec: SandboxSpec) -> BackendHandle:
        if not _SANDBOX_ID.match(spec.sandbox_id):
            raise BackendError(f"invalid sandbox id {spec.sandbox_id!r}")
        async with self._lock(spec.sandbox_id):
            existing = self._load_handle(spec.sandbox_id)
            if existing is not None and self._alive(existing):
                return existing
            if existing is not None:
                # A sandbox that died on its own: slirp4netns outlives the
                # namespace it served, and the cgroup may hold stragglers.
                await self._abandon_start(existing)
            if spec.network == "restricted" and self._isolation == "none":
                log.warning("sandbox_network_restricted_not_enforced", sandbox_id=spec.sandbox_id, isolation="none")
            try:
                if existing is None:
                    pooled = await self._create_from_pool(spec)
                    if pooled is not None:
                        return pooled
                return await self._start_retrying(spec, self._paths(spec.sandbox_id), self._dormant_after_s)
            finally:
                self._pool.refill(_pool_key(spec))

    async def _start_retrying(self, spec: SandboxSpec, paths: _Paths, dormant_after_s: float) -> BackendHandle:
        # bwrap's setup of the new namespace's loopback fails now and then
        # under load (a netlink error it reports with a stale errno);
        # nothing of the sandbox ran yet, so starting again is safe.
        for attempt in range(_START_ATTEMPTS):
            try:
                return await self._start(spec, paths, dormant_after_s)
            except SandboxStartError as exc:
                if "loopback: Failed" not in str(exc) or attempt == _START_ATTEMPTS - 1:
                    raise
                log.warning("sandbox_start_retried", sandbox_id=spec.sandbox_id, attempt=attempt + 1, error=str(exc))
                await asyncio.sleep(0.05 * 4**attempt)
        raise AssertionError("unreachable")

    async def pause(self, handle: BackendHandle) -> None:
        async with self._lock(handle.sandbox_id):
            if not self._alive(handle):
                raise SandboxGone(f"sandbox {handle.sandbox_id} is not running")
            # Files the daemon wrote are fsynced already; this covers what the
            # sandbox's own processes left in the page cache of its workspace,
            # without writing back every other tenant's and the host's (sync(2)).
            await asyncio.to_thread(sync_filesystem, Path(str(handle.private["workspace_dir"])))
            await self._set_frozen(handle, True)

    async def resume(self, handle: BackendHandle) -> None:
        async with self._lock(handle.sandbox_id):
            if not self._alive(handle):
                raise SandboxGone(f"sandbox {handle.sandbox_id} is not running")
            await self._set_frozen(handle, False)

    async def destroy(self, handle: BackendHandle) -> None:
        async with self._lock(handle.sandbox_id):
            cgroup = SandboxCgroup.from_private(handle.private.get("cgroups"))
            if self._alive(handle):
                with contextlib.suppress(BackendError):
                    await self._set_frozen(handle, False)
                with contextlib.suppress(DaemonUnavailable, DaemonError):
                    client = DaemonClient(handle.socket_path, connect_timeout_s=1.0, request_timeout_s=2.0)
                    try:
                        await client.shutdown()
                    finally:
                        await client.close()
                if not await self._wait_dead(handle, 3.0):
                    _signal_all(_process_tree(int(handle.private["pid"])), signal.SIGKILL)
            if cgroup is not None:
                cgroup.kill()
            _stop_user_network(handle)
            if not await self._wait_dead(handle, 10.0):
                raise BackendError(f"sandbox {handle.sandbox_id} did not stop")
            if cgroup is not None and not await cgroup.remove():
                log.warning("sandbox_cgroup_not_removed", sandbox_id=handle.sandbox_id, cgroup=dict(cgroup.dirs))
            self._reap(handle.sandbox_id)
            home = Path(str(handle.private["home"]))
            try:
                await unmount_under(home)
            except QuotaError as exc:
                raise BackendError(f"could not unmount the workspace of {handle.sandbox_id}: {exc}") from exc
            await asyncio.to_thread(shutil.rmtree, home, True)
            if home.exists():
                raise BackendError(f"could not delete {home}")
        self._locks.pop(handle.sandbox_id, None)

    async def adopt(self) -> list[BackendHandle]:
        root = self._data_dir / "sandboxes"
        if not root.is_dir():
            return []
        handles: list[BackendHandle] = []
        for home in sorted(root.iterdir()):
            handle = self._load_handle(home.name)
            if handle is not None and self._alive(handle):
                handles.append(handle)
        return handles

    async def is_alive(self, handle: BackendHandle) -> bool:
        return self._alive(handle)

    def leftover_handle(self, sandbox_id: str) -> BackendHandle | None:
        # The handle file is written as soon as the sandbox process exists.
        return self._load_handle(sandbox_id)

    def egress_socket_path(self, handle: BackendHandle) -> str | None:
        if handle.private.get("isolation") != "bwrap":
            return None
        return super().egress_socket_path(handle)

    async def start(self) -> None:
        """Prepares the isolation every sandbox shares, so the first create
        does not pay for it, and says in the log what is in force; what is
        missing fails each create with BackendUnavailable instead."""
        if self._isolation != "bwrap":
            return
        try:
            await asyncio.to_thread(self.assets)
        except BackendUnavailable as exc:
            log.error("sandbox_isolation_unavailable", error=str(exc))
            return
        await prepare_user_network(self._data_dir / "isolation")
        log.info("sandbox_isolation_ready", data_dir=self._install)
        await self._remove_leftover_pool()
        self._pool.start([])

    # ------------------------------------------------------------ warm pool

    def _pool_paths(self, slot: str) -> _Paths:
        home = self._data_dir / _POOL_DIR / slot
        return _Paths(home=home, workspace=home / "workspace", run=home / "run", mounted=home / "run" / "berth")

    def pool_ready(self, size: str, network: NetworkPolicy) -> int:
        """How many pooled sandboxes of this size and network are ready."""
        return self._pool.ready((size, network))

    async def _make_pooled(self, key: _PoolKey) -> BackendHandle:
        """A started sandbox of ``key`` in a slot directory of its own. Its
        daemon stays whole (no idle period) until a claim sets one, so a
        claim never waits for it to wake."""
        size, network = key
        slot = f"pool-{secrets.token_hex(6)}"
        spec = SandboxSpec(sandbox_id=slot, network=network, size=SIZES[size])
        async with self._lock(slot):
            return await self._start_retrying(spec, self._pool_paths(slot), 0.0)

    async def _discard_pooled(self, handle: BackendHandle) -> None:
        await self.destroy(handle)

    async def _create_from_pool(self, spec: SandboxSpec) -> BackendHandle | None:
        """``spec``'s sandbox made of a warm pool sandbox of its key, or None
        when the pool has none. A pooled sandbox is claimed once and never
        returns to the pool, so no claimant sees another's files, processes
        or variables. One that fails its claim is destroyed for the next."""
        paths = self._paths(spec.sandbox_id)
        if paths.home.exists():
            return None
        # take() awaits nothing, so concurrent creates never share one.
        while (pooled := self._pool.take(_pool_key(spec))) is not None:
            try:
                return await self._claim(pooled, spec, paths)
            except (BackendError, DaemonUnavailable, DaemonError, OSError) as exc:
                log.warning("pool_sandbox_discarded", sandbox_id=spec.sandbox_id, slot=pooled.sandbox_id, error=str(exc))
                await self._abandon_claim(pooled, paths)
        return None

    async def _claim(self, pooled: BackendHandle, spec: SandboxSpec, paths: _Paths) -> BackendHandle:
        """Makes a pooled sandbox ``spec``'s: its slot directory is renamed
        to the sandbox's (the bind mounts and the workspace's loop mount hold
        the directories, not their paths, so the running sandbox keeps them),
        its env.json becomes the spec's, and sandboxd re-reads it and takes
        up the idle period (its answer also proves the sandbox alive)."""
        slot = pooled.sandbox_id
        if not self._alive(pooled):
            raise SandboxGone(f"pool sandbox {slot} is not running")
        paths.home.parent.mkdir(parents=True, exist_ok=True)
        os.rename(str(pooled.private["home"]), paths.home)
        handle = BackendHandle(
            sandbox_id=spec.sandbox_id,
            socket_path=str(paths.socket),
            private={
                **pooled.private,
                "home": str(paths.home),
                "workspace_dir": str(paths.workspace),
                "run_dir": str(paths.run),
                "labels": dict(spec.labels),
                "pool_slot": slot,
            },
        )
        self._save_handle(handle)
        self._write_env(paths, spec, int(str(pooled.private["uid"])))
        popen = self._children.pop(slot, None)
        if popen is not None:
            self._children[spec.sandbox_id] = popen
        self._locks.pop(slot, None)
        client = DaemonClient(handle.socket_path, connect_timeout_s=2.0, request_timeout_s=5.0)
        try:
            await client.reload_env(dormant_after_s=self._dormant_after_s)
        finally:
            await client.close()
        log.info("sandbox_claimed_from_pool", sandbox_id=spec.sandbox_id, slot=slot, network=spec.network, size=spec.size.name)
        return handle

    async def _abandon_claim(self, pooled: BackendHandle, paths: _Paths) -> None:
        """Destroys a pooled sandbox whose claim failed, wherever its
        directory is now."""
        home = paths.home if paths.home.exists() and not Path(str(pooled.private["home"])).exists() else None
        handle = pooled
        if home is not None:
            handle = BackendHandle(
                pooled.sandbox_id,
                str(paths.socket),
                {**pooled.private, "home": str(home), "workspace_dir": str(paths.workspace), "run_dir": str(paths.run)},
            )
        with contextlib.suppress(BackendError):
            await self.destroy(handle)

    async def _remove_leftover_pool(self) -> None:
        """Destroys what an earlier process's pool left behind: a pooled
        sandbox is never handed over across restarts (it was made under that
        process's configuration)."""
        root = self._data_dir / _POOL_DIR
        if not root.is_dir():
            return
        for home in sorted(root.iterdir()):
            paths = self._pool_paths(home.name)
            try:
                handle = BackendHandle.from_json(paths.handle_file.read_text())
            except (OSError, ValueError, KeyError):
                await asyncio.to_thread(shutil.rmtree, home, True)
                continue
            with contextlib.suppress(BackendError):
                await self.destroy(handle)

    async def close(self) -> None:
        await self._pool.close()

    # ------------------------------------------------------------ isolation assets

    def assets(self) -> _Assets:
        """The shared pieces of confinement, made on first use; raises
        BackendUnavailable naming the first piece this host cannot provide."""
        if self._assets is not None:
            return self._assets
        for tool, package in (("bwrap", "bubblewrap"), ("slirp4netns", "slirp4netns"), ("nft", "nftables"), ("nsenter", "util-linux"), ("setpriv", "util-linux"), ("mkfs.ext4", "e2fsprogs")):
            if shutil.which(tool) is None:
                raise BackendUnavailable(
                    f"{tool} is not installed: install it (apt-get install {package}) "
                    "or set BERTH_SANDBOX_ISOLATION=none for development"
                )
        directory = self._data_dir / "isolation"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            directory.chmod(0o755)
            cgroups = detect_cgroups()
            seccomp = directory / "seccomp.bpf"
            write_filter(seccomp)
            seccomp = _copy_by_content(seccomp, directory, "seccomp", ".bpf")
            daemon = bundle.build(directory)
            etc = build_etc(directory, ca_bundle=self._ca_bundle)
        except CgroupError as exc:
            raise BackendUnavailable(f"sandbox limits cannot be enforced: {exc}") from exc
        except SeccompUnavailable as exc:
            raise BackendUnavailable(f"the sandbox syscall filter cannot be built: {exc}") from exc
        except OSError as exc:
            raise BackendUnavailable(f"cannot prepare sandbox isolation under {directory}: {exc}") from exc
        self._assets = _Assets(etc=etc, daemon=daemon, seccomp=seccomp, cgroups=cgroups)
        return self._assets

    # ------------------------------------------------------------ starting

    def _paths(self, sandbox_id: str) -> _Paths:
        home = self._data_dir / "sandboxes" / sandbox_id
        return _Paths(home=home, workspace=home / "workspace", run=home / "run", mounted=home / "run" / "berth")

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    def _load_handle(self, sandbox_id: str) -> BackendHandle | None:
        try:
            return BackendHandle.from_json(self._paths(sandbox_id).handle_file.read_text())
        except (OSError, ValueError, KeyError):
            return None

    async def _start(self, spec: SandboxSpec, paths: _Paths, dormant_after_s: float) -> BackendHandle:
        confined = self._isolation == "bwrap"
        assets = self.assets() if confined else None
        uid = host_uid(self._install, spec.sandbox_id) if confined else os.getuid()
        # Creating files waits on the host's filesystem (long, on one without
        # a journal that just deleted many): off the event loop.
        await asyncio.to_thread(self._prepare_dirs, paths, spec, uid, confined)
        if confined:
            try:
                await mount_workspace(
                    paths.image,
                    paths.workspace,
                    size_mib=spec.size.disk_mib,
                    uid=uid,
                    gid=uid,
                    templates=self._data_dir / "isolation" / "filesystems",
                )
            except QuotaError as exc:
                raise BackendUnavailable(f"the workspace disk quota cannot be applied: {exc}") from exc

        cgroup: SandboxCgroup | None = None
        freezer: FreezerKind = "signal"
        if assets is not None:
            try:
                # mkdir of a cgroup waits on the kernel; off the event loop.
                cgroup = await asyncio.to_thread(assets.cgroups.create, f"{self._cgroup_prefix}-{spec.sandbox_id}", spec.size)
            except CgroupError as exc:
                with contextlib.suppress(QuotaError):
                    await unmount_workspace(paths.workspace)
                raise BackendUnavailable(f"sandbox limits cannot be enforced: {exc}") from exc
            if self._freezer_choice != "signal":
                freezer = "cgroup_v2" if cgroup.version == "v2" else "cgroup_v1"
        elif self._freezer_choice not in ("auto", "signal"):
            raise BackendUnavailable(f"freezer {self._freezer_choice} needs isolation bwrap")

        private: dict[str, object] = {
            "isolation": self._isolation,
            "network": spec.network,
            "home": str(paths.home),
            "workspace_dir": str(paths.workspace),
            "run_dir": str(paths.run),
            "freezer": freezer,
            "cgroups": None if cgroup is None else cgroup.to_private(),
            "uid": uid,
            "gid": uid,
            "size": spec.size.name,
            "labels": dict(spec.labels),
        }
        # Spawned from a worker thread: Popen blocks its caller until bwrap
        # has exec'd, which would stall every other start on the event loop.
        info_fd: int | None = None
        if assets is not None and cgroup is not None:
            popen, info_fd = await asyncio.to_thread(self._spawn_confined, spec, paths, assets, cgroup, uid, dormant_after_s)
        else:
            popen = await asyncio.to_thread(self._spawn, self._unconfined_argv(paths, dormant_after_s), paths, env=_HOST_ENV)
        self._children[spec.sandbox_id] = popen
        stat = _proc_stat(popen.pid)
        handle = BackendHandle(
            sandbox_id=spec.sandbox_id,
            socket_path=str(paths.socket),
            private={"pid": popen.pid, "start_time": stat.start_time if stat is not None else 0, **private},
        )
        try:
            await asyncio.to_thread(self._save_handle, handle)
            # The daemon starts while the network is set up.
            ready = asyncio.ensure_future(self._wait_ready(handle, popen, awake=dormant_after_s == 0))
            try:
                if info_fd is not None:
                    handle = await self._start_network(handle, popen, spec, info_fd)
            except BaseException:
                ready.cancel()
                await asyncio.gather(ready, return_exceptions=True)
                raise
            await ready
        except BaseException:
            await self._abandon_start(handle)
            raise
        finally:
            if info_fd is not None:
                os.close(info_fd)
        log.info("sandbox_started", sandbox_id=spec.sandbox_id, pid=popen.pid, isolation=self._isolation, uid=uid, freezer=freezer)
        return handle

    def _prepare_dirs(self, paths: _Paths, spec: SandboxSpec, uid: int, confined: bool) -> None:
        """The sandbox's directories on the host, its env.json, and no
        socket of an earlier run."""
        paths.home.mkdir(mode=0o700, parents=True, exist_ok=True)
        paths.run.mkdir(mode=0o700, parents=True, exist_ok=True)
        (paths.mounted / "state").mkdir(mode=0o700, parents=True, exist_ok=True)
        for directory in (paths.mounted, paths.mounted / "state"):
            os.chown(directory, uid, uid)
        if not confined:
            paths.workspace.mkdir(parents=True, exist_ok=True)
        self._write_env(paths, spec, uid)
        with contextlib.suppress(FileNotFoundError):
            paths.socket.unlink()

    def _write_env(self, paths: _Paths, spec: SandboxSpec, uid: int) -> None:
        """The sandbox's env.json: what every command of it gets."""
        egress = egress_env() if spec.network == "restricted" and self._isolation == "bwrap" else {}
        if egress:
            # Tools with a bundle of their own (requests' certifi, node) trust
            # the generated one too, which holds the egress CA.
            egress.update(dict.fromkeys(_CA_ENV, _CA_IN_SANDBOX))
        tmp = paths.mounted / "env.json.tmp"
        tmp.write_text(json.dumps({**self._extra_env, **egress, **dict(spec.env)}))
        tmp.chmod(0o600)
        os.chown(tmp, uid, uid)
        tmp.replace(paths.mounted / "env.json")

    async def _abandon_start(self, handle: BackendHandle) -> None:
        """Undoes what a failed start, or a sandbox that died, left running
        or mounted; the workspace image stays, as ``destroy`` (or the next
        create) will find it."""
        if self._alive(handle):  # never a recycled pid's tree
            _signal_all(_process_tree(int(handle.private["pid"])), signal.SIGKILL)
        _stop_user_network(handle)
        cgroup = SandboxCgroup.from_private(handle.private.get("cgroups"))
        if cgroup is not None:
            cgroup.kill()
        await self._wait_dead(handle, 5.0)
        if cgroup is not None:
            await cgroup.remove()
        with contextlib.suppress(QuotaError):
            await unmount_workspace(Path(str(handle.private["workspace_dir"])))

    def _spawn(self, argv: list[str], paths: _Paths, *, env: Mapping[str, str], pass_fds: Sequence[int] = ()) -> subprocess.Popen[bytes]:
        with open(paths.run / "sandbox.log", "ab") as log_file:
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
                pass_fds=tuple(pass_fds),
                env=dict(env),
                cwd=paths.run,
            )

    def _spawn_confined(
        self, spec: SandboxSpec, paths: _Paths, assets: _Assets, cgroup: SandboxCgroup, uid: int, dormant_after_s: float
    ) -> tuple[subprocess.Popen[bytes], int]:
        """Starts the sandbox; returns its process and the read end of the
        pipe on which its bubblewrap announces the sandbox's first process
        (``--info-fd``; see ``_namespace_pid``), which the caller closes."""
        # The unprivileged uid bwrap runs as cannot (and must not) walk the
        # root-only host directories its mount sources live in. A first bwrap,
        # still root, stages them on a fresh tmpfs in a mount namespace of its
        # own; the second, as the sandbox's uid, binds them from there.
        # That namespace lives as long as the sandbox, so it holds only what
        # the second bwrap needs (``_staging_root``), never a copy of the
        # host's whole mount table: with one workspace mount per sandbox,
        # every namespace holding them all would make each mount and unmount
        # propagate to every other sandbox (quadratic in their number).
        sources = {
            "workspace": str(paths.workspace),
            "run": str(paths.mounted),
            "etc": str(assets.etc),
            "sandboxd.pyz": str(assets.daemon),
            **{f"ro{i}": host for i, (host, _) in enumerate(self._extra_ro_mounts)},
        }
        stage = {name: f"{_STAGE}/{name}" for name in sources}
        staging = ["bwrap", *_staging_root(), "--tmpfs", _STAGE]
        for name, host in sources.items():
            staging += ["--bind" if name in ("workspace", "run") else "--ro-bind", host, stage[name]]
        info_read, info_write = os.pipe()
        try:
            seccomp_fd = os.open(assets.seccomp, os.O_RDONLY | os.O_CLOEXEC)
            try:
                argv = [
                    "/bin/sh", "-c", _JOIN, "berth-join",
                    *staging, "--",
                    "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs",
                    "--inh-caps=-all", "--bounding-set=-all",
                    *self._bwrap_argv(spec, stage, seccomp_fd, info_write, dormant_after_s),
                ]  # fmt: skip
                env = {**_HOST_ENV, "BERTH_CGROUPS": " ".join(cgroup.procs_files())}
                popen = self._spawn(argv, paths, env=env, pass_fds=(seccomp_fd, info_write))
            finally:
                os.close(seccomp_fd)
        except BaseException:
            os.close(info_read)
            raise
        finally:
            os.close(info_write)
        os.set_blocking(info_read, False)
        return popen, info_read

    def _bwrap_argv(
        self, spec: SandboxSpec, stage: Mapping[str, str], seccomp_fd: int, info_fd: int, dormant_after_s: float
    ) -> list[str]:
        argv = [
            "bwrap",
            "--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_GID), "--disable-userns",
            "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net", "--unshare-cgroup",
            "--hostname", "sandbox",
            "--as-pid-1",
            "--new-session",
            "--cap-drop", "ALL",
            *_host_tops(),
            "--ro-bind", stage["etc"], "/etc",
            "--proc", "/proc",
            "--dev", "/dev",
            "--size", str(spec.size.tmp_mib * 1024 * 1024), "--tmpfs", "/tmp",
            "--bind", stage["workspace"], "/workspace",
            "--bind", stage["run"], _RUN_IN_SANDBOX,
            # sandboxd's process logs: bounded and charged to the sandbox's
            # memory, never to the host's disk outside the quota.
            "--size", str(spec.size.tmp_mib * 1024 * 1024), "--tmpfs", f"{_RUN_IN_SANDBOX}/state",
            "--ro-bind", stage["sandboxd.pyz"], _DAEMON_IN_SANDBOX,
            *[arg for i, (_, target) in enumerate(self._extra_ro_mounts) for arg in ("--ro-bind", stage[f"ro{i}"], target)],
            "--seccomp", str(seccomp_fd),
            # bwrap does not hand this descriptor to the sandbox's processes.
            "--info-fd", str(info_fd),
            "--chdir", "/workspace",
            "--setenv", "HOME", "/workspace",
            *self._daemon_command(_DAEMON_IN_SANDBOX, dormant_after_s),
            "--socket", f"{_RUN_IN_SANDBOX}/sandboxd.sock",
            "--workspace", "/workspace",
            "--state-dir", f"{_RUN_IN_SANDBOX}/state",
            "--isolation", "bwrap",
            "--env-file", f"{_RUN_IN_SANDBOX}/env.json",
        ]  # fmt: skip
        return argv

    def _daemon_command(self, archive: str, dormant_after_s: float) -> list[str]:
        # -I -S (launch): no site-packages, user site or PYTHON* variables; sandboxd
        # needs only the standard library, and every import is memory.
        # A daemon that may go dormant starts so: a sandbox costs its full
        # daemon only once something connects.
        dormant = ["--start-dormant"] if dormant_after_s > 0 else []
        return [*launch(self._python, archive), "--dormant-after", repr(dormant_after_s), *dormant]

    def _unconfined_argv(self, paths: _Paths, dormant_after_s: float) -> list[str]:
        return [
            *self._daemon_command(str(bundle.build(self._data_dir / "isolation")), dormant_after_s),
            "--socket", str(paths.socket),
            "--workspace", str(paths.workspace),
            "--state-dir", str(paths.mounted / "state"),
            "--isolation", "none",
            "--env-file", str(paths.mounted / "env.json"),
        ]  # fmt: skip

    async def _namespace_pid(self, popen: subprocess.Popen[bytes], info_fd: int) -> int:
        """The first process of the sandbox inside its own namespaces, as
        bubblewrap announces it on ``info_fd`` (``{"child-pid": N, ...}``)
        once they exist: the start waits for that, without polling."""
        try:
            async with asyncio.timeout(self._start_timeout_s):
                info = await _read_info(info_fd)
        except TimeoutError:
            raise SandboxStartError("the sandbox's namespaces did not appear") from None
        pid = info.get("child-pid") if isinstance(info, dict) else None
        if not isinstance(pid, int) or pid <= 1:
            # No announcement (the pipe closed): bwrap is exiting; its status, if it comes soon.
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(popen.wait, 1.0)
            status = "did not exit" if popen.returncode is None else f"exited with status {popen.returncode}"
            raise SandboxStartError(f"bubblewrap announced no sandbox process (it {status})")
        try:
            inside = os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
        except OSError:
            inside = False
        if not inside:
            raise SandboxStartError(f"the sandbox's process {pid} is not in a network namespace of its own")
        return pid

    async def _start_network(
        self, handle: BackendHandle, popen: subprocess.Popen[bytes], spec: SandboxSpec, info_fd: int
    ) -> BackendHandle:
        try:
            inner = await self._namespace_pid(popen, info_fd)
        except SandboxStartError as exc:
            raise SandboxStartError(f"sandbox {handle.sandbox_id}: {exc}: {self._log_tail(handle)}") from exc
        private = {**handle.private, "inner_pid": inner}
        if spec.network == "enabled":
            netns = Path(f"/proc/{inner}/ns/net")
            try:
                await apply_filter(netns, filter_ruleset(self._allow, await asyncio.to_thread(host_addresses)))
                user_network = await start_user_network(netns, Path(str(handle.private["run_dir"])) / "slirp.log")
            except NetworkSetupError as exc:
                if popen.poll() is not None:
                    # The sandbox died under its new namespace (as a failed
                    # loopback setup does): a start error, retried as one.
                    raise SandboxStartError(
                        f"sandbox {handle.sandbox_id} exited with status {popen.returncode} while starting: {self._log_tail(handle)}"
                    ) from exc
                raise BackendUnavailable(f"the network of sandbox {handle.sandbox_id} cannot be set up: {exc}") from exc
            private["user_network"] = user_network.to_private()
        handle = BackendHandle(handle.sandbox_id, handle.socket_path, private)
        await asyncio.to_thread(self._save_handle, handle)
        return handle

    def _save_handle(self, handle: BackendHandle) -> None:
        run = Path(str(handle.private["run_dir"]))
        tmp = run / "handle.json.tmp"
        tmp.write_text(handle.to_json())
        tmp.replace(run / "handle.json")
        (run / "bwrap.pid").write_text(f"{handle.private['pid']}\n")

    async def _wait_ready(self, handle: BackendHandle, popen: subprocess.Popen[bytes], *, awake: bool) -> None:
        """Until the daemon listens: an ``awake`` one answers a ping; one
        that starts dormant is only waited for until its socket exists
        (``sandboxd/listen.py``), since a connection would wake it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._start_timeout_s
        last_error: Exception | None = None
        while loop.time() < deadline:
            code = popen.poll()
            if code is not None:
                raise SandboxStartError(
                    f"sandbox {handle.sandbox_id} exited with status {code} while starting: {self._log_tail(handle)}"
                )
            if awake:
                last_error = await probe(handle.socket_path)
            elif os.path.exists(handle.socket_path):
                last_error = None
            else:
                last_error = DaemonUnavailable(f"no socket at {handle.socket_path}")
            if last_error is None:
                return
            await asyncio.sleep(_POLL_S)
        raise SandboxStartError(
            f"sandbox daemon {handle.sandbox_id} not ready after {self._start_timeout_s}s "
            f"({last_error!r}): {self._log_tail(handle)}"
        )

    def _log_tail(self, handle: BackendHandle) -> str:
        try:
            data = (Path(str(handle.private["run_dir"])) / "sandbox.log").read_bytes()
        except OSError:
            return "(no log)"
        return data[-2000:].decode(errors="replace").strip()

    # ------------------------------------------------------------ liveness

    def _alive(self, handle: BackendHandle) -> bool:
        popen = self._children.get(handle.sandbox_id)
        if popen is not None and popen.pid == handle.private.get("pid"):
            popen.poll()
        stat = _proc_stat(int(handle.private["pid"]))
        # The start time guards against a recycled pid.
        return stat is not None and stat.state not in ("Z", "X") and stat.start_time == handle.private.get("start_time")

    async def _wait_dead(self, handle: BackendHandle, timeout_s: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._alive(handle):
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(_POLL_S)
        return True

    def _reap(self, sandbox_id: str) -> None:
        popen = self._children.pop(sandbox_id, None)
        if popen is not None:
            popen.poll()

    # ------------------------------------------------------------ freezing

    async def _set_frozen(self, handle: BackendHandle, frozen: bool) -> None:
        kind = cast(FreezerKind, handle.private.get("freezer", "signal"))
        cgroup = SandboxCgroup.from_private(handle.private.get("cgroups"))
        if kind != "signal" and cgroup is not None:
            try:
                await cgroup.set_frozen(frozen)
            except CgroupError as exc:
                raise BackendError(str(exc)) from exc
        else:
            await self._signal_freeze(handle, frozen)

    async def _signal_freeze(self, handle: BackendHandle, frozen: bool) -> None:
        root = int(handle.private["pid"])
        if not frozen:
            _signal_all(_process_tree(root), signal.SIGCONT)
            return
        # A process may fork between the scan and the stop, so scan again
        # until the tree holds no process that was not stopped.
        stopped: set[int] = set()
        for _ in range(50):
            fresh = [pid for pid in _process_tree(root) if pid not in stopped]
            if not fresh:
                break
            _signal_all(fresh, signal.SIGSTOP)
            stopped.update(fresh)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10.0
        while True:
            states = [_proc_stat(pid) for pid in _process_tree(root)]
            if all(s is None or s.state in ("T", "t") for s in states):
                return
            if loop.time() >= deadline:
                raise BackendError(f"sandbox {handle.sandbox_id} did not stop")
            await asyncio.sleep(_POLL_S)
