"""The ``local`` backend: sandboxd under bubblewrap on this host.

Layout of one sandbox::

    <data_dir>/sandboxes/<sandbox_id>/
        workspace/        bind-mounted read-write at /workspace
        run/              host only: handle.json, bwrap.pid, sandbox.log
        run/berth/        bind-mounted at /run/berth: sandboxd.sock, env.json, state/,
                          egress.sock (restricted only; served by the Sandbox service)

Host-side bookkeeping stays out of the mounted directory so nothing inside the
sandbox can make the service signal an arbitrary host pid.

bwrap is started in its own session and without ``--die-with-parent``, so a
sandbox outlives a restart of the Sandbox service; ``adopt`` finds it again
through ``handle.json``. The daemon is the sandbox's PID 1 (``--as-pid-1``):
when it exits the kernel kills everything left in the sandbox.

Network: ``enabled`` shares the host's network namespace; ``disabled`` and
``restricted`` get their own (``--unshare-net``) with only loopback. A
``restricted`` sandbox's commands get ``HTTP(S)_PROXY`` pointing at
sandboxd's loopback relay of its egress proxy (``base.egress_env``), which
the Sandbox service serves on ``run/berth/egress.sock``; they reach the
outside through that proxy only. Unconfined sandboxes (isolation ``none``)
share the host's network whatever their policy.

Pause freezes the sandbox's cgroup (cgroup v2 ``cgroup.freeze`` or the cgroup
v1 freezer); with no writable freezer it falls back to SIGSTOP/SIGCONT of
every process in the tree.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

import structlog

from services.sandbox.backends.base import (
    BackendError,
    BackendHandle,
    BackendUnavailable,
    SandboxBackend,
    SandboxGone,
    SandboxSpec,
    SandboxStartError,
    egress_env,
)
from services.sandbox.daemon_client import DaemonClient, DaemonError, DaemonUnavailable, probe

__all__ = ["LocalBackend", "Isolation", "FreezerKind", "detect_freezers"]

Isolation = Literal["bwrap", "none"]
FreezerKind = Literal["cgroup_v2", "cgroup_v1", "signal"]

log = structlog.stdlib.get_logger(__name__)

_SANDBOX_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_DEFAULT_DAEMON = Path(__file__).resolve().parent.parent / "daemon" / "sandboxd.py"
_DAEMON_IN_SANDBOX = "/opt/berth/sandboxd.py"
_RUN_IN_SANDBOX = "/run/berth"
# bwrap and the daemon must not inherit the service's environment (API keys,
# database URLs); commands get only what the sandbox spec grants them.
_HOST_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
_JOIN_CGROUP = '{ echo $$ > "$0"; } 2>/dev/null || echo "berth: could not join cgroup $0" >&2; exec "$@"'
_POLL_S = 0.01


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


def _process_tree(root: int) -> list[int]:
    """``root`` and its live descendants, parents before children."""
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


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _cgroup_mounts() -> tuple[Path | None, Path | None]:
    """Mount points of the cgroup v2 hierarchy and of the v1 freezer."""
    v2: Path | None = None
    v1_freezer: Path | None = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) < 4:
                continue
            mount_point, fs_type, options = parts[1], parts[2], parts[3].split(",")
            if fs_type == "cgroup2" and v2 is None:
                v2 = Path(mount_point)
            elif fs_type == "cgroup" and "freezer" in options and v1_freezer is None:
                v1_freezer = Path(mount_point)
    return v2, v1_freezer


def detect_freezers() -> list[tuple[FreezerKind, Path | None]]:
    """Usable freezers on this host, best first, each with the directory
    under which sandbox cgroups are created (None for signals)."""
    v2, v1 = _cgroup_mounts()
    candidates: list[tuple[FreezerKind, Path]] = []
    if v2 is not None and v2 == Path("/sys/fs/cgroup"):
        candidates.append(("cgroup_v2", v2))
    if v1 is not None:
        candidates.append(("cgroup_v1", v1))
    if v2 is not None and v2 != Path("/sys/fs/cgroup"):
        candidates.append(("cgroup_v2", v2))
    usable: list[tuple[FreezerKind, Path | None]] = []
    for kind, mount in candidates:
        base = mount / "berth"
        try:
            base.mkdir(exist_ok=True)
        except OSError:
            continue
        control = "cgroup.procs"
        if (base / control).exists() and os.access(base / control, os.W_OK):
            usable.append((kind, base))
    usable.append(("signal", None))
    return usable


_RESERVED_TARGETS = ("/", "/proc", "/dev", "/workspace", _RUN_IN_SANDBOX, _DAEMON_IN_SANDBOX)


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


class LocalBackend(SandboxBackend):
    name = "local"

    def __init__(
        self,
        data_dir: Path,
        isolation: Isolation = "bwrap",
        daemon_path: Path | None = None,
        extra_env: Mapping[str, str] | None = None,
        *,
        freezer: FreezerKind | Literal["auto"] = "auto",
        python: str | None = None,
        start_timeout_s: float = 15.0,
        extra_ro_mounts: Mapping[str | Path, str] | None = None,
    ) -> None:
        """``python`` is the interpreter that runs sandboxd: ``python3`` from
        the sandbox's PATH under bubblewrap, this interpreter when unconfined.
        ``extra_ro_mounts`` maps host paths to absolute sandbox paths that
        bubblewrap binds read-only (e.g. a Python site-packages for MCP
        servers); unconfined sandboxes see the host's paths and ignore it."""
        self._data_dir = Path(data_dir).resolve()
        self._isolation: Isolation = isolation
        self._daemon_path = (daemon_path or _DEFAULT_DAEMON).resolve()
        self._extra_env = dict(extra_env or {})
        self._freezer_choice = freezer
        self._python = python or ("python3" if isolation == "bwrap" else sys.executable)
        self._start_timeout_s = start_timeout_s
        self._extra_ro_mounts = _check_mounts(extra_ro_mounts or {})
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        # Sandbox cgroups of different data dirs (tests, several installs)
        # must not collide on one host.
        self._cgroup_prefix = hashlib.sha256(str(self._data_dir).encode()).hexdigest()[:8]
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
            if self._isolation == "bwrap" and shutil.which("bwrap") is None:
                raise BackendUnavailable(
                    "bubblewrap (bwrap) is not installed: install it (apt-get install bubblewrap) "
                    "or set BERTH_SANDBOX_ISOLATION=none for development"
                )
            if spec.network == "restricted" and self._isolation == "none":
                log.warning("sandbox_network_restricted_not_enforced", sandbox_id=spec.sandbox_id, isolation="none")
            return await self._start(spec)

    async def pause(self, handle: BackendHandle) -> None:
        async with self._lock(handle.sandbox_id):
            if not self._alive(handle):
                raise SandboxGone(f"sandbox {handle.sandbox_id} is not running")
            # Files the daemon wrote are fsynced already; this covers what the
            # sandbox's own processes left in the page cache.
            await asyncio.to_thread(os.sync)
            await self._set_frozen(handle, True)

    async def resume(self, handle: BackendHandle) -> None:
        async with self._lock(handle.sandbox_id):
            if not self._alive(handle):
                raise SandboxGone(f"sandbox {handle.sandbox_id} is not running")
            await self._set_frozen(handle, False)

    async def destroy(self, handle: BackendHandle) -> None:
        async with self._lock(handle.sandbox_id):
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
            self._kill_cgroup(handle)
            if not await self._wait_dead(handle, 10.0):
                raise BackendError(f"sandbox {handle.sandbox_id} did not stop")
            await self._remove_cgroup(handle)
            self._reap(handle.sandbox_id)
            home = Path(str(handle.private["home"]))
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

    async def _start(self, spec: SandboxSpec) -> BackendHandle:
        paths = self._paths(spec.sandbox_id)
        paths.workspace.mkdir(parents=True, exist_ok=True)
        paths.run.mkdir(mode=0o700, parents=True, exist_ok=True)
        (paths.mounted / "state").mkdir(mode=0o700, parents=True, exist_ok=True)
        env_file = paths.mounted / "env.json"
        egress = egress_env() if spec.network == "restricted" and self._isolation == "bwrap" else {}
        env_file.write_text(json.dumps({**self._extra_env, **egress, **dict(spec.env)}))
        env_file.chmod(0o600)
        with contextlib.suppress(FileNotFoundError):
            paths.socket.unlink()

        freezer, cgroup = self._make_cgroup(spec.sandbox_id)
        argv = self._bwrap_argv(spec, paths) if self._isolation == "bwrap" else self._unconfined_argv(paths)
        if cgroup is not None:
            # Joining before exec puts every later sandbox process in the
            # cgroup with no window in which a child could escape it.
            argv = ["/bin/sh", "-c", _JOIN_CGROUP, str(cgroup / "cgroup.procs"), *argv]
        with open(paths.run / "sandbox.log", "ab") as log_file:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
                env=_HOST_ENV,
                cwd=paths.run,
            )
        self._children[spec.sandbox_id] = popen
        stat = _proc_stat(popen.pid)
        handle = BackendHandle(
            sandbox_id=spec.sandbox_id,
            socket_path=str(paths.socket),
            private={
                "pid": popen.pid,
                "start_time": stat.start_time if stat is not None else 0,
                "isolation": self._isolation,
                "network": spec.network,
                "home": str(paths.home),
                "workspace_dir": str(paths.workspace),
                "run_dir": str(paths.run),
                "freezer": freezer,
                "cgroup": None if cgroup is None else str(cgroup),
                "labels": dict(spec.labels),
            },
        )
        self._save_handle(handle)
        await self._wait_ready(handle, popen)
        if cgroup is not None and popen.pid not in self._cgroup_pids(handle):
            log.warning("sandbox_cgroup_join_failed", sandbox_id=spec.sandbox_id, cgroup=str(cgroup))
            await self._remove_cgroup(handle)
            handle = dataclasses.replace(handle, private={**handle.private, "freezer": "signal", "cgroup": None})
            self._save_handle(handle)
        log.info("sandbox_started", sandbox_id=spec.sandbox_id, pid=popen.pid, isolation=self._isolation, freezer=handle.private["freezer"])
        return handle

    def _save_handle(self, handle: BackendHandle) -> None:
        run = Path(str(handle.private["run_dir"]))
        tmp = run / "handle.json.tmp"
        tmp.write_text(handle.to_json())
        tmp.replace(run / "handle.json")
        (run / "bwrap.pid").write_text(f"{handle.private['pid']}\n")

    def _bwrap_argv(self, spec: SandboxSpec, paths: _Paths) -> list[str]:
        argv = [
            "bwrap",
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
            "--hostname",
            "sandbox",
            "--as-pid-1",
            "--new-session",
            # Root outside must not mean privileges inside.
            "--cap-drop",
            "ALL",
        ]
        if spec.network != "enabled":
            argv.append("--unshare-net")
        argv += ["--ro-bind", "/usr", "/usr"]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(top):
                argv += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                argv += ["--ro-bind", top, top]
        argv += ["--ro-bind", "/etc", "/etc"]
        resolv = os.path.realpath("/etc/resolv.conf")
        if spec.network == "enabled" and not resolv.startswith("/etc/") and os.path.exists(resolv):
            # A resolv.conf symlinked into /run (systemd-resolved) would dangle.
            argv += ["--ro-bind", resolv, resolv]
        argv += [
            "--proc", "/proc",
            "--dev", "/dev",
            "--tmpfs", "/tmp",
            "--bind", str(paths.workspace), "/workspace",
            "--bind", str(paths.mounted), _RUN_IN_SANDBOX,
            "--ro-bind", str(self._daemon_path), _DAEMON_IN_SANDBOX,
            *[arg for host, target in self._extra_ro_mounts for arg in ("--ro-bind", host, target)],
            "--chdir", "/workspace",
            self._python, _DAEMON_IN_SANDBOX,
            "--socket", f"{_RUN_IN_SANDBOX}/sandboxd.sock",
            "--workspace", "/workspace",
            "--state-dir", f"{_RUN_IN_SANDBOX}/state",
            "--isolation", "bwrap",
            "--env-file", f"{_RUN_IN_SANDBOX}/env.json",
        ]  # fmt: skip
        return argv

    def _unconfined_argv(self, paths: _Paths) -> list[str]:
        return [
            self._python,
            str(self._daemon_path),
            "--socket", str(paths.socket),
            "--workspace", str(paths.workspace),
            "--state-dir", str(paths.mounted / "state"),
            "--isolation", "none",
            "--env-file", str(paths.mounted / "env.json"),
        ]  # fmt: skip

    async def _wait_ready(self, handle: BackendHandle, popen: subprocess.Popen[bytes]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._start_timeout_s
        last_error: Exception | None = None
        while loop.time() < deadline:
            code = popen.poll()
            if code is not None:
                raise SandboxStartError(
                    f"sandbox {handle.sandbox_id} exited with status {code} while starting: {self._log_tail(handle)}"
                )
            last_error = await probe(handle.socket_path)
            if last_error is None:
                return
            await asyncio.sleep(_POLL_S)
        _signal_all(_process_tree(popen.pid), signal.SIGKILL)
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

    def _make_cgroup(self, sandbox_id: str) -> tuple[FreezerKind, Path | None]:
        choices = detect_freezers()
        if self._freezer_choice != "auto":
            choices = [c for c in choices if c[0] == self._freezer_choice]
            if not choices:
                raise BackendUnavailable(f"freezer {self._freezer_choice} is not usable on this host")
        kind, base = choices[0]
        if base is None:
            return kind, None
        cgroup = base / f"{self._cgroup_prefix}-{sandbox_id}"
        try:
            cgroup.mkdir(exist_ok=True)
        except OSError as exc:
            log.warning("sandbox_cgroup_unavailable", sandbox_id=sandbox_id, error=str(exc))
            return "signal", None
        return kind, cgroup

    def _cgroup_pids(self, handle: BackendHandle) -> list[int]:
        cgroup = handle.private.get("cgroup")
        if not cgroup:
            return []
        try:
            text = (Path(str(cgroup)) / "cgroup.procs").read_text()
        except OSError:
            return []
        return [int(line) for line in text.split()]

    async def _set_frozen(self, handle: BackendHandle, frozen: bool) -> None:
        kind = cast(FreezerKind, handle.private.get("freezer", "signal"))
        cgroup = Path(str(handle.private.get("cgroup")))
        if kind == "cgroup_v1":
            target = "FROZEN" if frozen else "THAWED"
            await self._write_until(cgroup / "freezer.state", target, cgroup / "freezer.state", target)
        elif kind == "cgroup_v2":
            value = "1" if frozen else "0"
            await self._write_until(cgroup / "cgroup.freeze", value, cgroup / "cgroup.events", f"frozen {value}")
        else:
            await self._signal_freeze(handle, frozen)

    async def _write_until(self, control: Path, value: str, status: Path, expected: str) -> None:
        """Writes a freezer control and waits until the kernel reports the
        state; a v1 freezer can stall in FREEZING, and rewriting retries it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10.0
        while True:
            try:
                control.write_text(value)
                reached = expected in status.read_text().splitlines()
            except OSError as exc:
                raise BackendError(f"cannot write {control}: {exc}") from exc
            if reached:
                return
            if loop.time() >= deadline:
                raise BackendError(f"{control} did not reach {expected!r}")
            await asyncio.sleep(_POLL_S)

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

    def _kill_cgroup(self, handle: BackendHandle) -> None:
        if handle.private.get("freezer") == "cgroup_v2":
            with contextlib.suppress(OSError):
                (Path(str(handle.private["cgroup"])) / "cgroup.kill").write_text("1")
        for _ in range(8):
            pids = self._cgroup_pids(handle)
            if not pids:
                return
            _signal_all(pids, signal.SIGKILL)

    async def _remove_cgroup(self, handle: BackendHandle) -> None:
        cgroup = handle.private.get("cgroup")
        if not cgroup:
            return
        path = Path(str(cgroup))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5.0
        while path.exists():
            try:
                path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                # Busy until the last killed member has been reaped.
                if loop.time() >= deadline:
                    log.warning("sandbox_cgroup_not_removed", sandbox_id=handle.sandbox_id, cgroup=str(path))
                    return
                self._kill_cgroup(handle)
                await asyncio.sleep(_POLL_S)
