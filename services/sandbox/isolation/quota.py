"""The workspace as a filesystem of fixed size: the disk quota.

Each sandbox's workspace is an ext4 filesystem in a sparse image file under
its host directory, loop-mounted (``nosuid,nodev,noatime``) on the workspace
directory that the backend binds at ``/workspace``. A write past the size
fails with ENOSPC inside that sandbox alone, and the host's disk holds only
the blocks really written. The mount lives in the host's mount namespace,
so the workspace survives a restart of the Sandbox service with the sandbox.

The loop device is attached and the filesystem mounted and unmounted here,
with the kernel's calls (``LOOP_CONFIGURE``, mount(2), umount2(2)) in a
worker thread, not by mount(8): its loop set-up reads every loop device and
mount of the host each time, which costs more the more sandboxes there are.
The device is attached with autoclear, so the kernel releases it when the
filesystem is unmounted.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import functools
import os
import re
import secrets
import shutil
import stat
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path

from services.sandbox.isolation.commands import TOOL_PATH, run_tool

__all__ = [
    "QuotaError",
    "mount_workspace",
    "unmount_workspace",
    "sync_filesystem",
    "is_mounted",
    "mounts_under",
    "unmount_under",
    "IMAGE_NAME",
]

IMAGE_NAME = "workspace.ext4"
_TIMEOUT_S = 30.0
_UNMOUNT_PASSES = 8

_LOOP_CONTROL = "/dev/loop-control"
_LOOP_MAJOR = 7
# linux/loop.h
_LOOP_SET_FD = 0x4C00
_LOOP_CLR_FD = 0x4C01
_LOOP_SET_STATUS64 = 0x4C04
_LOOP_GET_STATUS64 = 0x4C05
_LOOP_CONFIGURE = 0x4C0A  # Linux 5.8
_LOOP_CTL_GET_FREE = 0x4C82
_LO_FLAGS_AUTOCLEAR = 4
_LO_NAME_SIZE = 64
# struct loop_info64: lo_device, lo_inode, lo_rdevice, lo_offset,
# lo_sizelimit (u64); lo_number, lo_encrypt_type, lo_encrypt_key_size,
# lo_flags (u32); lo_file_name[64], lo_crypt_name[64], lo_encrypt_key[32];
# lo_init[2] (u64). 232 bytes.
_LOOP_INFO64 = struct.Struct("=5Q4I64s64s32s2Q")
# struct loop_config: fd, block_size (u32); struct loop_info64 info;
# __reserved[8] (u64). 304 bytes.
_LOOP_CONFIG = struct.Struct(f"=2I{_LOOP_INFO64.size}s8Q")
# Concurrent attaches (in this process or another) are handed the same free
# device and all but one get EBUSY; each loser asks again.
_ATTACH_TRIES = 64

# linux/mount.h
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_NOATIME = 1024
_MNT_DETACH = 2
_UMOUNT_NOFOLLOW = 8

_COPY_CHUNK = 64 * 1024
_ZEROS = bytes(_COPY_CHUNK)


class QuotaError(Exception):
    """The workspace filesystem could not be made or mounted."""


async def _run(argv: Sequence[str]) -> None:
    await run_tool(argv, error=QuotaError, timeout_s=_TIMEOUT_S)


def _failed(step: str, error: OSError | int) -> QuotaError:
    code = error if isinstance(error, int) else (error.errno or 0)
    return QuotaError(f"{step} failed: {errno.errorcode.get(code, str(code))} ({os.strerror(code)})")


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
    libc.mount.restype = ctypes.c_int
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.umount2.restype = ctypes.c_int
    libc.syncfs.argtypes = [ctypes.c_int]
    libc.syncfs.restype = ctypes.c_int
    return libc


def sync_filesystem(path: Path) -> None:
    """Writes back the dirty pages of the one filesystem that holds ``path``
    (syncfs(2)), and no other of the host's. For a workspace on its quota's
    loop-mounted image that ends with a cache flush of the loop device,
    which the kernel turns into an fsync of the image file."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if _libc().syncfs(fd) != 0:
            raise _failed(f"syncing {path}", ctypes.get_errno())
    finally:
        os.close(fd)


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


def _data_extents(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """The ``(start, end)`` ranges of ``fd`` that hold data, by SEEK_DATA and
    SEEK_HOLE. A filesystem that cannot tell reports one range, the whole file."""
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # a hole up to the end
                return
            if exc.errno == errno.EINVAL and pos == 0:
                yield 0, size
                return
            raise
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        if end <= start:
            return
        yield start, end
        pos = end


def _write_nonzero(src: int, dst: int, pos: int, end: int) -> None:
    """Copies ``[pos, end)`` by reading and writing, leaving chunks of zeros
    unwritten: the destination, already truncated to size, has holes there."""
    while pos < end:
        chunk = os.pread(src, min(_COPY_CHUNK, end - pos), pos)
        if not chunk:
            return
        if chunk != (_ZEROS if len(chunk) == _COPY_CHUNK else bytes(len(chunk))):
            view = memoryview(chunk)
            while view:
                written = os.pwrite(dst, view, pos + len(chunk) - len(view))
                view = view[written:]
        pos += len(chunk)


def _copy_extent(src: int, dst: int, pos: int, end: int) -> None:
    while pos < end:
        try:
            copied = os.copy_file_range(src, dst, end - pos, pos, pos)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            break
        if copied == 0:
            return
        pos += copied
    _write_nonzero(src, dst, pos, end)


def _copy_sparse(source: Path, dest: Path, *, replace: Path | None = None) -> None:
    """Copies ``source`` to a new file ``dest`` byte for byte, writing only
    its data extents, so that ``dest`` is as sparse as ``source``; then
    renames it to ``replace``, if given."""
    try:
        src = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
        try:
            info = os.fstat(src)
            size = info.st_size
            dst = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, stat.S_IMODE(info.st_mode))
            try:
                os.ftruncate(dst, size)
                extents = list(_data_extents(src, size))
                if extents == [(0, size)]:
                    # No hole reported: perhaps the filesystem cannot report
                    # them; find the zeros the way cp --sparse=always does.
                    _write_nonzero(src, dst, 0, size)
                else:
                    for start, end in extents:
                        _copy_extent(src, dst, start, end)
            except BaseException:
                os.close(dst)
                with contextlib.suppress(OSError):
                    dest.unlink()
                raise
            os.close(dst)
        finally:
            os.close(src)
        if replace is not None:
            dest.replace(replace)
    except OSError as exc:
        raise QuotaError(f"copying {source} to {dest} failed: {exc}") from exc


def _loop_info(image: Path) -> bytes:
    name = os.fsencode(image)[: _LO_NAME_SIZE - 1]
    return _LOOP_INFO64.pack(0, 0, 0, 0, 0, 0, 0, 0, _LO_FLAGS_AUTOCLEAR, name, b"", b"", 0, 0)


def _open_loop_device(number: int) -> int | None:
    """An O_RDWR descriptor of /dev/loop``number``, making its node first if
    /dev has none yet (as util-linux does); None if the device went away."""
    path = f"/dev/loop{number}"
    if not os.path.exists(path):
        try:
            major, minor = (int(n) for n in Path(f"/sys/block/loop{number}/dev").read_text().split(":"))
        except (OSError, ValueError):
            major, minor = _LOOP_MAJOR, number
        try:
            os.mknod(path, stat.S_IFBLK | 0o600, os.makedev(major, minor))
        except FileExistsError:
            pass
        except OSError as exc:
            raise _failed(f"making {path}", exc) from exc
    try:
        return os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # removed since LOOP_CTL_GET_FREE
            return None
        raise _failed(f"opening {path}", exc) from exc


def _configure_loop(loop_fd: int, image_fd: int, image: Path) -> bool:
    """Attaches ``image_fd`` to the loop device with autoclear; False if
    another attach took the device first."""
    info = _loop_info(image)
    try:
        fcntl.ioctl(loop_fd, _LOOP_CONFIGURE, _LOOP_CONFIG.pack(image_fd, 0, info, *([0] * 8)))
        return True
    except OSError as exc:
        if exc.errno == errno.EBUSY:
            return False
        if exc.errno not in (errno.EINVAL, errno.ENOTTY):
            raise _failed(f"LOOP_CONFIGURE of {image}", exc) from exc
    # A kernel before 5.8: attach, then set the flags.
    try:
        fcntl.ioctl(loop_fd, _LOOP_SET_FD, image_fd)
    except OSError as exc:
        if exc.errno == errno.EBUSY:
            return False
        raise _failed(f"LOOP_SET_FD of {image} (the kernel has no LOOP_CONFIGURE)", exc) from exc
    try:
        fcntl.ioctl(loop_fd, _LOOP_SET_STATUS64, info)
    except OSError as exc:
        with contextlib.suppress(OSError):
            fcntl.ioctl(loop_fd, _LOOP_CLR_FD, 0)
        raise _failed(f"LOOP_SET_STATUS64 of {image}", exc) from exc
    return True


def _attach_loop(image_fd: int, image: Path) -> tuple[int, str]:
    """A loop device backed by ``image_fd``: its open descriptor and path."""
    try:
        control = os.open(_LOOP_CONTROL, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise _failed(f"opening {_LOOP_CONTROL}", exc) from exc
    try:
        for _ in range(_ATTACH_TRIES):
            try:
                number = fcntl.ioctl(control, _LOOP_CTL_GET_FREE)
            except OSError as exc:
                raise _failed("LOOP_CTL_GET_FREE", exc) from exc
            loop_fd = _open_loop_device(number)
            if loop_fd is None:
                continue
            try:
                attached = _configure_loop(loop_fd, image_fd, image)
            except BaseException:
                os.close(loop_fd)
                raise
            if attached:
                return loop_fd, f"/dev/loop{number}"
            os.close(loop_fd)
    finally:
        os.close(control)
    raise QuotaError(f"attaching {image} failed: every free loop device was taken by another attach ({_ATTACH_TRIES} tries)")


def _attached_device(image_fd: int, image: Path) -> tuple[int, str] | None:
    """A loop device the image is attached to already (its workspace was
    unmounted lazily and is still held), as mount(8) finds one: mounting it
    again shares that filesystem, where a second device would put a second
    ext4 on the same image. Its descriptor is held, so it stays attached."""
    image_stat = os.fstat(image_fd)
    backing = str(image.resolve())
    for name in os.listdir("/sys/block"):
        if not name.startswith("loop"):
            continue
        try:
            if Path(f"/sys/block/{name}/loop/backing_file").read_text().rstrip("\n") != backing:
                continue
            loop_fd = os.open(f"/dev/{name}", os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            status = _LOOP_INFO64.unpack(fcntl.ioctl(loop_fd, _LOOP_GET_STATUS64, bytes(_LOOP_INFO64.size)))
        except OSError:
            status = None
        if status is not None and (status[0], status[1], status[3]) == (image_stat.st_dev, image_stat.st_ino, 0):
            return loop_fd, f"/dev/{name}"
        os.close(loop_fd)
    return None


def _mount_image(image: Path, mount_point: Path, *, new_image: bool) -> None:
    """``mount -o loop,nosuid,nodev,noatime image mount_point``. A
    ``new_image`` (made just now) is attached to no loop device yet."""
    try:
        image_fd = os.open(image, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise _failed(f"opening {image}", exc) from exc
    try:
        attached = None if new_image else _attached_device(image_fd, image)
        loop_fd, device = attached or _attach_loop(image_fd, image)
        try:
            libc = _libc()
            flags = _MS_NOSUID | _MS_NODEV | _MS_NOATIME
            if libc.mount(os.fsencode(device), os.fsencode(mount_point), b"ext4", flags, None) != 0:
                failure = _failed(f"mounting {image} ({device}) on {mount_point}", ctypes.get_errno())
                if attached is None:  # ours to detach
                    with contextlib.suppress(OSError):
                        fcntl.ioctl(loop_fd, _LOOP_CLR_FD, 0)
                raise failure
        finally:
            # The mounted filesystem holds the device now; autoclear
            # releases it when that is unmounted.
            os.close(loop_fd)
    finally:
        os.close(image_fd)


def _own_workspace(mount_point: Path, uid: int, gid: int) -> None:
    os.chown(mount_point, uid, gid)
    os.chmod(mount_point, 0o755)
    lost = mount_point / "lost+found"
    with contextlib.suppress(OSError):
        if lost.is_dir() and not any(lost.iterdir()):
            lost.rmdir()


def _mount_point_ready(mount_point: Path, image: Path) -> bool | None:
    """Makes the mount point; None if something is mounted there already,
    else whether the image is still to be made."""
    mount_point.mkdir(parents=True, exist_ok=True)
    if is_mounted(mount_point):
        return None
    return not image.exists()


async def mount_workspace(
    image: Path, mount_point: Path, *, size_mib: int, uid: int, gid: int, templates: Path | None = None
) -> None:
    """Mounts ``image`` on ``mount_point``, first making an empty filesystem
    of ``size_mib`` owned by ``uid``:``gid`` when there is no image yet. An
    existing image (a sandbox started again) keeps its files and its size.
    ``templates`` is a directory of empty filesystems, one per size, made
    once and copied (sparsely, a few MiB) instead of running mkfs each time."""
    if shutil.which("mkfs.ext4", path=TOOL_PATH) is None:
        raise QuotaError("mkfs.ext4 is needed for the workspace disk quota (apt-get install e2fsprogs)")
    if not os.path.exists(_LOOP_CONTROL):
        raise QuotaError(f"{_LOOP_CONTROL} is needed for the workspace disk quota (modprobe loop)")
    new_image = await asyncio.to_thread(_mount_point_ready, mount_point, image)
    if new_image is None:
        return
    if new_image:
        tmp = image.with_name(f".{image.name}.{secrets.token_hex(6)}.tmp")
        if templates is not None:
            template = templates / f"empty-{size_mib}m.ext4"
            async with _TEMPLATE_LOCKS.setdefault(template, asyncio.Lock()):
                if not template.exists():
                    templates.mkdir(parents=True, exist_ok=True)
                    await _make_filesystem(template, size_mib)
            await asyncio.to_thread(_copy_sparse, template, tmp, replace=image)
        else:
            await _make_filesystem(tmp, size_mib)
            tmp.replace(image)
    await asyncio.to_thread(_mount_owned, image, mount_point, new_image=new_image, uid=uid, gid=gid)


def _mount_owned(image: Path, mount_point: Path, *, new_image: bool, uid: int, gid: int) -> None:
    _mount_image(image, mount_point, new_image=new_image)
    _own_workspace(mount_point, uid, gid)


def _unmount(mount_point: Path) -> None:
    libc = _libc()
    target = os.fsencode(mount_point)
    if libc.umount2(target, _UMOUNT_NOFOLLOW) == 0:
        return
    code, step = ctypes.get_errno(), f"unmounting {mount_point}"
    if code == errno.EBUSY:
        if libc.umount2(target, _UMOUNT_NOFOLLOW | _MNT_DETACH) == 0:
            return
        code, step = ctypes.get_errno(), f"unmounting {mount_point} lazily"
    if code == errno.EINVAL and not is_mounted(mount_point):  # unmounted meanwhile
        return
    raise _failed(step, code)


async def unmount_workspace(mount_point: Path) -> None:
    """Unmounts the workspace (lazily if a process still holds it: the loop
    device is released when the last one lets go)."""
    if not is_mounted(mount_point):
        return
    await asyncio.to_thread(_unmount, mount_point)


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
