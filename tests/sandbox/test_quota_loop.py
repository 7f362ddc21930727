"""The workspace disk quota on the real kernel: loop devices attached with
LOOP_CONFIGURE (or LOOP_SET_FD) and autoclear, mount(2) and umount2(2), and
the sparse copy of a template filesystem (``isolation/quota.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from waiting import wait_until

from services.sandbox.isolation import quota
from services.sandbox.isolation.commands import TOOL_PATH
from services.sandbox.isolation.quota import QuotaError, is_mounted, mount_workspace, unmount_under, unmount_workspace

pytestmark = pytest.mark.timeout(120)

_LOOP_CLR_FD = 0x4C01
_MIB = 1024 * 1024


@pytest.fixture(autouse=True)
def _require_bwrap() -> None:
    """Replaces the directory-wide bubblewrap check: these tests need root
    and loop devices, not bwrap (the local backend's bwrap isolation needs
    both, so CI, which requires bwrap, requires them too)."""
    missing = [
        what
        for what, present in (
            ("root", os.geteuid() == 0),
            ("/dev/loop-control", os.path.exists("/dev/loop-control")),
            ("mkfs.ext4", shutil.which("mkfs.ext4", path=TOOL_PATH) is not None),
        )
        if not present
    ]
    if missing:
        if os.environ.get("BERTH_REQUIRE_BWRAP") == "1":
            pytest.fail(f"the disk quota is required (BERTH_REQUIRE_BWRAP=1) but needs {', '.join(missing)}")
        pytest.skip(f"the disk quota needs {', '.join(missing)}")


def _backing_files() -> dict[str, str]:
    """Each attached loop device (``loopN``) and its backing file."""
    found: dict[str, str] = {}
    for device in Path("/sys/block").glob("loop*"):
        with contextlib.suppress(OSError):
            found[device.name] = (device / "loop" / "backing_file").read_text().strip()
    return found


def _devices_backed_by(path: Path) -> list[str]:
    return [device for device, backing in _backing_files().items() if backing == str(path)]


async def _wait_detached(*images: Path) -> None:
    """Waits until no loop device is backed by ``images``. Autoclear detaches
    at once, unless a mount namespace made meanwhile (another test's sandbox)
    copied the mount and holds the filesystem until it lets go."""
    await wait_until(lambda: not any(_devices_backed_by(image) for image in images), what=f"{images} detached")


def _detach_loops_under(root: Path) -> None:
    for device, backing in _backing_files().items():
        if backing.startswith(str(root) + "/"):
            with contextlib.suppress(OSError):
                fd = os.open(f"/dev/{device}", os.O_RDWR | os.O_CLOEXEC)
                try:
                    fcntl.ioctl(fd, _LOOP_CLR_FD, 0)
                finally:
                    os.close(fd)


@pytest.fixture
async def root(tmp_path: Path) -> AsyncIterator[Path]:
    """A directory for images and mount points; nothing mounted or attached
    below it outlives the test."""
    try:
        yield tmp_path
    finally:
        await unmount_under(tmp_path)
        _detach_loops_under(tmp_path)


@dataclass(frozen=True)
class Mount:
    source: str
    fstype: str
    options: frozenset[str]


def _mount_at(point: Path) -> Mount:
    """The topmost mount on ``point`` in /proc/self/mountinfo."""
    found: Mount | None = None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(point):
            after = fields[fields.index("-") + 1 :]
            found = Mount(source=after[1], fstype=after[0], options=frozenset(fields[5].split(",")))
    assert found is not None, f"nothing is mounted on {point}"
    return found


def _digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


async def test_a_mounted_workspace_is_a_loop_backed_ext4_mounted_nosuid_nodev_noatime(root: Path) -> None:
    image, point = root / "workspace.ext4", root / "workspace"

    await mount_workspace(image, point, size_mib=32, uid=4321, gid=4322)

    mount = _mount_at(point)
    device = mount.source.removeprefix("/dev/")
    assert mount.fstype == "ext4" and device.startswith("loop"), mount
    assert {"nosuid", "nodev", "noatime"} <= mount.options, mount
    assert _backing_files()[device] == str(image)
    assert Path(f"/sys/block/{device}/loop/autoclear").read_text().strip() == "1"
    assert (point.stat().st_uid, point.stat().st_gid, point.stat().st_mode & 0o7777) == (4321, 4322, 0o755)
    assert list(point.iterdir()) == []  # the empty lost+found is gone


async def test_a_write_past_the_size_fails_with_enospc(root: Path) -> None:
    point = root / "workspace"
    await mount_workspace(root / "workspace.ext4", point, size_mib=16, uid=0, gid=0)

    written = 0
    with pytest.raises(OSError) as raised:
        with open(point / "big", "wb") as f:
            for _ in range(64):
                f.write(b"x" * _MIB)
                f.flush()
                written += 1

    assert raised.value.errno == errno.ENOSPC
    assert written < 16


async def test_unmounting_detaches_the_loop_device(root: Path) -> None:
    image, point = root / "workspace.ext4", root / "workspace"
    await mount_workspace(image, point, size_mib=16, uid=0, gid=0)
    device = _mount_at(point).source.removeprefix("/dev/")

    await unmount_workspace(point)

    assert not is_mounted(point)
    await _wait_detached(image)
    # The device itself is free (or already someone else's).
    with contextlib.suppress(FileNotFoundError):
        assert Path(f"/sys/block/{device}/loop/backing_file").read_text().strip() != str(image)


async def test_a_busy_workspace_is_unmounted_lazily_and_its_device_freed_when_let_go(root: Path) -> None:
    image, point = root / "workspace.ext4", root / "workspace"
    await mount_workspace(image, point, size_mib=16, uid=0, gid=0)
    holder = open(point / "held", "wb")
    try:
        await unmount_workspace(point)

        assert not is_mounted(point)
        assert len(_devices_backed_by(image)) == 1
    finally:
        holder.close()
    await _wait_detached(image)


async def test_a_lazily_unmounted_workspace_mounted_again_shares_its_device_and_filesystem(root: Path) -> None:
    image, point = root / "workspace.ext4", root / "workspace"
    await mount_workspace(image, point, size_mib=16, uid=0, gid=0)
    device = _mount_at(point).source
    holder = open(point / "held", "w")
    try:
        await unmount_workspace(point)

        await mount_workspace(image, point, size_mib=16, uid=0, gid=0)
        holder.write("written through the old mount")
        holder.flush()

        assert _mount_at(point).source == device
        assert len(_devices_backed_by(image)) == 1  # not a second ext4 on the same image
        assert (point / "held").read_text() == "written through the old mount"
    finally:
        holder.close()
    await unmount_workspace(point)
    await _wait_detached(image)


async def test_two_dozen_concurrent_mounts_each_get_their_own_loop_device(root: Path) -> None:
    templates = root / "templates"
    images = [root / f"sb{i}" / "workspace.ext4" for i in range(24)]
    for image in images:
        image.parent.mkdir()

    await asyncio.gather(
        *(mount_workspace(image, image.parent / "ws", size_mib=32, uid=0, gid=0, templates=templates) for image in images)
    )

    devices = [_mount_at(image.parent / "ws").source for image in images]
    assert len(set(devices)) == len(images), devices
    backing = _backing_files()
    assert [backing[d.removeprefix("/dev/")] for d in devices] == [str(image) for image in images]
    await unmount_under(root)
    await _wait_detached(*images)


class _FirstFreeIsTaken:
    """fcntl for quota.py whose first LOOP_CTL_GET_FREE answers a device
    another attach has just taken."""

    def __init__(self, taken: int) -> None:
        self.taken: int | None = taken
        self.answers: list[int] = []

    def ioctl(self, fd: int, request: int, arg: int | bytes = 0) -> int | bytes:
        if request == quota._LOOP_CTL_GET_FREE:
            if self.taken is not None:
                number, self.taken = self.taken, None
            else:
                number = fcntl.ioctl(fd, request)
            self.answers.append(number)
            return number
        return fcntl.ioctl(fd, request, arg)


async def test_an_attach_that_loses_its_free_device_to_another_takes_the_next(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other, image, point = root / "other.ext4", root / "workspace.ext4", root / "workspace"
    await mount_workspace(other, root / "other", size_mib=16, uid=0, gid=0)
    taken = int(_mount_at(root / "other").source.removeprefix("/dev/loop"))
    fake = _FirstFreeIsTaken(taken)
    monkeypatch.setattr(quota, "fcntl", fake)

    await mount_workspace(image, point, size_mib=16, uid=0, gid=0)

    assert fake.answers[0] == taken and len(fake.answers) == 2
    assert _mount_at(point).source == f"/dev/loop{fake.answers[1]}" != f"/dev/loop{taken}"


async def test_a_kernel_without_loop_configure_attaches_with_set_fd_and_autoclear(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    image, point = root / "workspace.ext4", root / "workspace"
    monkeypatch.setattr(quota, "_LOOP_CONFIGURE", 0x4C7F)  # unknown to the loop driver: EINVAL

    await mount_workspace(image, point, size_mib=16, uid=0, gid=0)

    device = _mount_at(point).source.removeprefix("/dev/")
    assert _backing_files()[device] == str(image)
    assert Path(f"/sys/block/{device}/loop/autoclear").read_text().strip() == "1"
    await unmount_workspace(point)
    await _wait_detached(image)


async def test_an_image_that_does_not_mount_raises_and_leaves_no_loop_device(root: Path) -> None:
    image, point = root / "workspace.ext4", root / "workspace"
    with open(image, "wb") as f:
        f.truncate(16 * _MIB)  # no filesystem in it

    with pytest.raises(QuotaError, match="mounting.*EINVAL"):
        await mount_workspace(image, point, size_mib=16, uid=0, gid=0)

    assert not is_mounted(point)
    assert _devices_backed_by(image) == []


async def test_without_loop_control_no_workspace_is_mounted(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quota, "_LOOP_CONTROL", str(root / "loop-control"))

    with pytest.raises(QuotaError, match="loop-control"):
        await mount_workspace(root / "workspace.ext4", root / "workspace", size_mib=16, uid=0, gid=0)

    assert not (root / "workspace.ext4").exists()


async def test_a_remounted_image_keeps_its_files_and_size(root: Path) -> None:
    image, point = root / "workspace.ext4", root / "workspace"
    await mount_workspace(image, point, size_mib=16, uid=0, gid=0)
    (point / "kept.txt").write_text("still here")
    await unmount_workspace(point)

    await mount_workspace(image, point, size_mib=64, uid=0, gid=0)

    assert (point / "kept.txt").read_text() == "still here"
    assert image.stat().st_size == 16 * _MIB


@pytest.fixture
def sparse_file(tmp_path: Path) -> Iterator[Path]:
    """64 MiB with data at its start, in its middle and at its end."""
    path = tmp_path / "source"
    with open(path, "wb") as f:
        f.truncate(64 * _MIB)
        for offset in (0, 10 * _MIB + 123, 64 * _MIB - 4096):
            f.seek(offset)
            f.write(os.urandom(4096))
    yield path


def test_the_sparse_copy_is_byte_identical_and_as_sparse(sparse_file: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"

    quota._copy_sparse(sparse_file, dest)

    assert _digest(dest) == _digest(sparse_file)
    assert dest.stat().st_blocks <= sparse_file.stat().st_blocks
    assert dest.stat().st_blocks * 512 < _MIB


def test_the_sparse_copy_reads_and_writes_where_copy_file_range_is_refused(
    sparse_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dest = tmp_path / "dest"

    def refuse(*args: object) -> int:
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(os, "copy_file_range", refuse)

    quota._copy_sparse(sparse_file, dest)

    assert _digest(dest) == _digest(sparse_file)
    assert dest.stat().st_blocks * 512 < _MIB


def test_the_sparse_copy_of_a_file_without_holes_leaves_its_zeros_as_holes(tmp_path: Path) -> None:
    source, dest = tmp_path / "source", tmp_path / "dest"
    source.write_bytes(os.urandom(4096) + bytes(16 * _MIB) + os.urandom(100))

    quota._copy_sparse(source, dest)

    assert _digest(dest) == _digest(source)
    assert dest.stat().st_blocks * 512 < _MIB


async def test_a_template_filesystem_copies_byte_identical_and_as_sparse(root: Path) -> None:
    templates, copy = root / "templates", root / "copy.ext4"
    await mount_workspace(root / "workspace.ext4", root / "workspace", size_mib=64, uid=0, gid=0, templates=templates)
    template = templates / "empty-64m.ext4"

    quota._copy_sparse(template, copy)

    assert _digest(copy) == _digest(template)
    assert copy.stat().st_size == 64 * _MIB
    assert copy.stat().st_blocks <= template.stat().st_blocks < 64 * _MIB // 512 // 4
