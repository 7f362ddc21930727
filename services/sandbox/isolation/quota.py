"""The workspace as a filesystem of fixed size: the disk quota.

Each sandbox's workspace is an ext4 filesystem in a sparse image file under
its host directory, loop-mounted (``nosuid,nodev``) on the workspace
directory that the backend binds at ``/workspace``. A write past the size
fails with ENOSPC inside that sandbox alone, and the host's disk holds only
the blocks really written. The mount lives in the host's mount namespace,
so the workspace survives a restart of the Sandbox service with the sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import shutil
from collections.abc import Sequence
from pathlib import Path

from services.sandbox.isolation.commands import TOOL_PATH, run_tool

__all__ = ["QuotaError", "mount_workspace", "unmount_workspace", "is_mounted", "mounts_under", "unmount_under", "IMAGE_NAME"]

IMAGE_NAME = "workspace.ext4"
_TIMEOUT_S = 30.0
_UNMOUNT_PASSES = 8


class QuotaError(Exception):
    """The workspace filesystem could not be made or mounted."""


async def _run(argv: Sequence[str]) -> None:
    await run_tool(argv, error=QuotaError, timeout_s=_TIMEOUT_S)


def is_mounted(mount_point: Path) -> bool:
    return os.path.ismount(mount_point)


# One template being made per path at a time in this process; other
# processes make their own copy under a unique name, and the rename is atomic.
_TEMPLATE_LOCKS: dict[Path, asyncio.Lock] = {}


async def _make_filesystem(path: Path, size_mib: int) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    with open(tmp, "wb") as f:
        f.truncate(size_mib * 1024 * 1024)
    await _run(["mkfs.ext4", "-q", "-F", "-m", "0", "-E", "lazy_itable_init=1,lazy_journal_init=1", str(tmp)])
    tmp.replace(path)


async def mount_workspace(
    image: Path, mount_point: Path, *, size_mib: int, uid: int, gid: int, templates: Path | None = None
) -> None:
    """Mounts ``image`` on ``mount_point``, first making an empty filesystem
    of ``size_mib`` owned by ``uid``:``gid`` when there is no image yet. An
    existing image (a sandbox started again) keeps its files and its size.
    ``templates`` is a directory of empty filesystems, one per size, made
    once and copied (sparsely, a few MiB) instead of running mkfs each time."""
    for tool in ("mkfs.ext4", "mount", "umount", "cp"):
        if shutil.which(tool, path=TOOL_PATH) is None:
            raise QuotaError(f"{tool} is needed for the workspace disk quota (apt-get install e2fsprogs mount)")
    mount_point.mkdir(parents=True, exist_ok=True)
    if is_mounted(mount_point):
        return
    if not image.exists():
        tmp = image.with_name(f".{image.name}.{secrets.token_hex(6)}.tmp")
        if templates is not None:
            template = templates / f"empty-{size_mib}m.ext4"
            async with _TEMPLATE_LOCKS.setdefault(template, asyncio.Lock()):
                if not template.exists():
                    templates.mkdir(parents=True, exist_ok=True)
                    await _make_filesystem(template, size_mib)
            await _run(["cp", "--sparse=always", str(template), str(tmp)])
        else:
            await _make_filesystem(tmp, size_mib)
        tmp.replace(image)
    await _run(["mount", "-o", "loop,nosuid,nodev,noatime", str(image), str(mount_point)])
    os.chown(mount_point, uid, gid)
    os.chmod(mount_point, 0o755)
    lost = mount_point / "lost+found"
    with contextlib.suppress(OSError):
        if lost.is_dir() and not any(lost.iterdir()):
            lost.rmdir()


async def unmount_workspace(mount_point: Path) -> None:
    """Unmounts the workspace (lazily if a process still holds it: the loop
    device is released when the last one lets go)."""
    if not is_mounted(mount_point):
        return
    try:
        await _run(["umount", str(mount_point)])
    except QuotaError:
        await _run(["umount", "--lazy", str(mount_point)])


def _unescape_mount_path(field: str) -> str:
    """A path of /proc/self/mountinfo, whose space, tab, newline and
    backslash are written as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mounts_under(root: Path) -> list[Path]:
    """Mount points at or below ``root`` in this mount namespace, deepest first."""
    prefix = str(root.resolve())
    found: set[str] = set()
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            fields = line.split()
            if len(fields) < 5:
                continue
            point = _unescape_mount_path(fields[4])
            if point == prefix or point.startswith(prefix.rstrip("/") + "/"):
                found.add(point)
    return [Path(p) for p in sorted(found, key=lambda p: (p.count("/"), p), reverse=True)]


async def unmount_under(root: Path) -> None:
    """Unmounts every filesystem mounted at or below ``root`` (deepest
    first), so that deleting ``root`` never reaches into a mounted one.
    Filesystems stacked on one mount point go one per pass."""
    for _ in range(_UNMOUNT_PASSES):
        points = await asyncio.to_thread(mounts_under, root)
        if not points:
            return
        for point in points:
            await unmount_workspace(point)
    raise QuotaError(f"filesystems are still mounted below {root}")
