"""Each sandbox's cgroup: memory (with swap), pids and CPU limits, the
freezer, and a kill that reaches every process.

Both hierarchies are supported. cgroup v2 (``/sys/fs/cgroup`` mounted as
``cgroup2``): one directory ``berth/<name>`` with ``memory.max``,
``memory.swap.max = 0``, ``pids.max``, ``cpu.max``, ``cgroup.freeze`` and
``cgroup.kill``. cgroup v1: one directory ``berth/<name>`` in each of the
memory, pids, cpu and freezer hierarchies, with ``memory.limit_in_bytes``
and ``memory.memsw.limit_in_bytes`` (memory plus swap; required when the
host has swap), ``pids.max``, ``cpu.cfs_quota_us`` and ``freezer.state``.

The sandbox's first process joins every directory before it execs
bubblewrap (``join_command``), so no process of the sandbox ever runs
outside them. A memory overrun is handled by the kernel's OOM killer inside
the sandbox's own cgroup; sandboxd raises each command's ``oom_score_adj``
to 500 (its own stays 0), so it is a command that dies, and the sandbox
goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from services.sandbox.isolation.sizes import ContainerSize

__all__ = ["CgroupError", "CgroupHost", "SandboxCgroup", "detect_cgroups", "LIMIT_CONTROLLERS"]

Version = Literal["v1", "v2"]
LIMIT_CONTROLLERS = ("memory", "pids", "cpu")
_CPU_PERIOD_US = 100_000
_POLL_S = 0.01


class CgroupError(Exception):
    """A cgroup could not be made, limited, joined, frozen or removed."""


def _mounts() -> list[tuple[str, str, list[str]]]:
    found: list[tuple[str, str, list[str]]] = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 4:
                found.append((parts[1], parts[2], parts[3].split(",")))
    return found


def _swap_total_kib() -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("SwapTotal:"):
                return int(line.split()[1])
    return 0


@dataclass(frozen=True)
class CgroupHost:
    """Where this host's sandbox cgroups are made: per controller (v1) or
    one directory (v2, under the key ``"unified"``)."""

    version: Version
    bases: Mapping[str, Path]
    swap_accounted: bool

    def create(self, name: str, size: ContainerSize) -> SandboxCgroup:
        """Makes the sandbox's cgroup with ``size``'s limits (an existing one,
        from an earlier start, gets them again)."""
        dirs: dict[str, str] = {}
        try:
            for controller, base in self.bases.items():
                path = base / name
                path.mkdir(exist_ok=True)
                dirs[controller] = str(path)
            group = SandboxCgroup(self.version, dirs)
            group.set_limits(size, swap_accounted=self.swap_accounted)
        except OSError as exc:
            raise CgroupError(f"cannot set up the sandbox's cgroup {name}: {exc}") from exc
        return group


def detect_cgroups() -> CgroupHost:
    """This host's cgroups, or CgroupError naming what is missing."""
    mounts = _mounts()
    unified = next((Path(m) for m, fs, _ in mounts if fs == "cgroup2" and m == "/sys/fs/cgroup"), None)
    if unified is not None:
        return _detect_v2(unified)
    bases: dict[str, Path] = {}
    for controller in (*LIMIT_CONTROLLERS, "freezer"):
        mount = next((Path(m) for m, fs, opts in mounts if fs == "cgroup" and controller in opts), None)
        if mount is None:
            raise CgroupError(f"the cgroup v1 {controller} controller is not mounted")
        base = mount / "berth"
        try:
            base.mkdir(exist_ok=True)
        except OSError as exc:
            raise CgroupError(f"cannot create {base}: {exc}") from exc
        if not os.access(base / "cgroup.procs", os.W_OK):
            raise CgroupError(f"{base} is not writable")
        bases[controller] = base
    memsw = (bases["memory"] / "memory.memsw.limit_in_bytes").exists()
    if not memsw and _swap_total_kib() > 0:
        raise CgroupError("the host has swap but no swap accounting (boot with swapaccount=1), so memory cannot be limited with swap")
    return CgroupHost("v1", bases, swap_accounted=memsw)


def _detect_v2(root: Path) -> CgroupHost:
    base = root / "berth"
    try:
        available = set((root / "cgroup.controllers").read_text().split())
        missing = [c for c in LIMIT_CONTROLLERS if c not in available]
        if missing:
            raise CgroupError(f"cgroup v2 controllers {', '.join(missing)} are not available")
        base.mkdir(exist_ok=True)
        wanted = " ".join(f"+{c}" for c in LIMIT_CONTROLLERS)
        for parent in (root, base):
            (parent / "cgroup.subtree_control").write_text(wanted)
    except OSError as exc:
        raise CgroupError(f"cannot delegate memory, pids and cpu to {base}: {exc}") from exc
    swap = (base / "memory.swap.max").exists() or _swap_total_kib() == 0
    return CgroupHost("v2", {"unified": base}, swap_accounted=swap)


@dataclass(frozen=True)
class SandboxCgroup:
    version: Version
    dirs: Mapping[str, str]

    def to_private(self) -> dict[str, object]:
        return {"version": self.version, "dirs": dict(self.dirs)}

    @classmethod
    def from_private(cls, raw: object) -> SandboxCgroup | None:
        if not isinstance(raw, dict) or raw.get("version") not in ("v1", "v2"):
            return None
        return cls(raw["version"], {str(k): str(v) for k, v in dict(raw.get("dirs") or {}).items()})

    def procs_files(self) -> list[str]:
        return [str(Path(d) / "cgroup.procs") for d in self.dirs.values()]

    def _dir(self, controller: str) -> Path:
        return Path(self.dirs["unified" if self.version == "v2" else controller])

    def set_limits(self, size: ContainerSize, *, swap_accounted: bool) -> None:
        memory = size.memory_mib * 1024 * 1024
        quota = size.cpu_millis * _CPU_PERIOD_US // 1000
        if self.version == "v2":
            d = self._dir("memory")
            (d / "memory.max").write_text(str(memory))
            if (d / "memory.swap.max").exists():
                (d / "memory.swap.max").write_text("0")
            (d / "pids.max").write_text(str(size.pids))
            (d / "cpu.max").write_text(f"{quota} {_CPU_PERIOD_US}")
            return
        mem = self._dir("memory")
        memsw = mem / "memory.memsw.limit_in_bytes"
        # memsw may never be below the memory limit: raise it first, lower it last.
        if swap_accounted and int(memsw.read_text()) < memory:
            memsw.write_text(str(memory))
        (mem / "memory.limit_in_bytes").write_text(str(memory))
        if swap_accounted:
            memsw.write_text(str(memory))
        (self._dir("pids") / "pids.max").write_text(str(size.pids))
        cpu = self._dir("cpu")
        (cpu / "cpu.cfs_period_us").write_text(str(_CPU_PERIOD_US))
        (cpu / "cpu.cfs_quota_us").write_text(str(quota))

    def pids(self) -> list[int]:
        try:
            text = (self._dir("pids") / "cgroup.procs").read_text()
        except OSError:
            return []
        return [int(line) for line in text.split()]

    async def set_frozen(self, frozen: bool) -> None:
        if self.version == "v2":
            value = "1" if frozen else "0"
            d = self._dir("freezer")
            await _write_until(d / "cgroup.freeze", value, d / "cgroup.events", f"frozen {value}")
        else:
            state = self._dir("freezer") / "freezer.state"
            target = "FROZEN" if frozen else "THAWED"
            await _write_until(state, target, state, target)

    def kill(self) -> None:
        if self.version == "v2":
            with contextlib.suppress(OSError):
                (self._dir("pids") / "cgroup.kill").write_text("1")
        for _ in range(8):
            members = self.pids()
            if not members:
                return
            for pid in members:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    async def remove(self, timeout_s: float = 5.0) -> bool:
        """Removes every directory once its last member is gone; False if
        one was still busy after ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        for d in {Path(p) for p in self.dirs.values()}:
            while d.exists():
                try:
                    d.rmdir()
                except FileNotFoundError:
                    break
                except OSError:
                    # Busy until the last killed member has been reaped.
                    if loop.time() >= deadline:
                        return False
                    self.kill()
                    await asyncio.sleep(_POLL_S)
        return True


async def _write_until(control: Path, value: str, status: Path, expected: str) -> None:
    """Writes a freezer control and waits until the kernel reports the state;
    a v1 freezer can stall in FREEZING, and rewriting retries it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10.0
    while True:
        try:
            control.write_text(value)
            reached = expected in status.read_text().splitlines()
        except OSError as exc:
            raise CgroupError(f"cannot write {control}: {exc}") from exc
        if reached:
            return
        if loop.time() >= deadline:
            raise CgroupError(f"{control} did not reach {expected!r}")
        await asyncio.sleep(_POLL_S)
