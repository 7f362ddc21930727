"""The ``file.*`` ops, confined to the workspace.

A path whose ``..`` components climb out of the root is ``invalid_argument``;
a path that leaves the root through a symlink is ``permission_denied``.
Inside a bubblewrap or container sandbox this confinement defines the API
rather than a security boundary: the sandbox's own processes can already
reach everything the daemon can.
"""

from __future__ import annotations

import asyncio
import errno
import os
import stat
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from .protocol import MAX_READ_CHUNK, MAX_WRITE_BYTES, Handler, Json, OpError, Sender, b64, opt_bool, opt_int, unb64
from .workspace import VIRTUAL_ROOT, Workspace

MAX_LIST_ENTRIES = 100000


def _os_error(exc: OSError, path: str) -> OpError:
    if isinstance(exc, FileNotFoundError):
        return OpError("not_found", "%s does not exist" % path)
    if isinstance(exc, PermissionError):
        return OpError("permission_denied", "permission denied: %s" % path)
    if isinstance(exc, FileExistsError):
        return OpError("failed_precondition", "%s already exists" % path)
    if isinstance(exc, IsADirectoryError):
        return OpError("failed_precondition", "%s is a directory" % path)
    if isinstance(exc, NotADirectoryError):
        return OpError("failed_precondition", "a component of %s is not a directory" % path)
    if exc.errno == errno.ENOTEMPTY:
        return OpError("failed_precondition", "%s is not empty" % path)
    if exc.errno == errno.ELOOP:
        return OpError("permission_denied", "%s is a symlink" % path)
    if exc.errno == errno.ENOSPC:
        return OpError("failed_precondition", "no space left writing %s" % path)
    return OpError("internal", "%s: %s" % (path, exc.strerror or exc))


class Files:
    """The ``file.*`` ops. File I/O runs off the loop so a slow disk never
    stalls other requests."""

    def __init__(self, workspace: Workspace) -> None:
        self.workspace = workspace

    def handlers(self) -> Dict[str, Handler]:
        return {
            "file.write": self._op_file_write,
            "file.read": self._op_file_read,
            "file.list": self._op_file_list,
            "file.stat": self._op_file_stat,
            "file.mkdir": self._op_file_mkdir,
            "file.remove": self._op_file_remove,
        }

    async def _blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def _op_file_write(self, conn: Sender, rid: int, req: Json) -> Json:
        path = req.get("path")
        data = unb64(req.get("data_b64", ""), "data_b64")
        if len(data) > MAX_WRITE_BYTES:
            raise OpError("invalid_argument", "at most %d bytes per write" % MAX_WRITE_BYTES)
        mode = opt_int(req, "mode", None)
        if mode is not None and not 0 <= mode <= 0o7777:
            raise OpError("invalid_argument", "mode must be a permission mode")
        append = opt_bool(req, "append", False)
        parents = opt_bool(req, "mkdir_parents", True)
        real = self.workspace.resolve(path)
        if real == self.workspace.root:
            raise OpError("failed_precondition", "%s is a directory" % path)
        size = await self._blocking(_write_file, real, data, mode, append, parents, str(path))
        return {"size": size}

    async def _op_file_read(self, conn: Sender, rid: int, req: Json) -> Json:
        path = req.get("path")
        offset = opt_int(req, "offset", 0) or 0
        length = opt_int(req, "length", None)
        if offset < 0 or (length is not None and length < 0):
            raise OpError("invalid_argument", "offset and length must not be negative")
        real = self.workspace.resolve(path)
        fd, size = await self._blocking(_open_for_read, real, str(path))
        try:
            end = size if length is None else min(size, offset + length)
            position = offset
            while position < end:
                data = await self._blocking(os.pread, fd, min(MAX_READ_CHUNK, end - position), position)
                if not data:
                    break
                await conn.send({"id": rid, "type": "chunk", "data_b64": b64(data)})
                position += len(data)
        finally:
            os.close(fd)
        return {"size": size}

    async def _op_file_list(self, conn: Sender, rid: int, req: Json) -> Json:
        path = req.get("path") or VIRTUAL_ROOT
        recursive = opt_bool(req, "recursive", False)
        real = self.workspace.resolve(path)
        entries, truncated = await self._blocking(self._list, real, recursive, str(path))
        return {"entries": entries, "truncated": truncated}

    async def _op_file_stat(self, conn: Sender, rid: int, req: Json) -> Json:
        path = req.get("path")
        real = self.workspace.resolve(path, follow_final=False)
        try:
            st = os.lstat(real)
        except OSError as exc:
            raise _os_error(exc, str(path)) from None
        return {"entry": self._entry(real, st)}

    async def _op_file_mkdir(self, conn: Sender, rid: int, req: Json) -> Json:
        path = req.get("path")
        parents = opt_bool(req, "parents", True)
        real = self.workspace.resolve(path)
        try:
            if parents:
                _makedirs(real)
            else:
                os.mkdir(real)
        except OSError as exc:
            raise _os_error(exc, str(path)) from None
        return {"path": self.workspace.to_virtual(real)}

    async def _op_file_remove(self, conn: Sender, rid: int, req: Json) -> Json:
        path = req.get("path")
        recursive = opt_bool(req, "recursive", False)
        real = self.workspace.resolve(path, follow_final=False)
        if real == self.workspace.root:
            raise OpError("invalid_argument", "the workspace root cannot be removed")
        await self._blocking(_remove, real, recursive, str(path))
        return {"removed": True}

    def _entry(self, real: str, st: os.stat_result) -> Json:
        if stat.S_ISLNK(st.st_mode):
            kind = "symlink"
        elif stat.S_ISDIR(st.st_mode):
            kind = "dir"
        elif stat.S_ISREG(st.st_mode):
            kind = "file"
        else:
            kind = "other"
        return {
            "path": self.workspace.to_virtual(real),
            "type": kind,
            "size": st.st_size,
            "mode": stat.S_IMODE(st.st_mode),
            "mtime": st.st_mtime,
        }

    def _list(self, real: str, recursive: bool, shown: str) -> Tuple[List[Json], bool]:
        try:
            if not stat.S_ISDIR(os.stat(real).st_mode):
                raise OpError("failed_precondition", "%s is not a directory" % shown)
        except OSError as exc:
            raise _os_error(exc, shown) from None
        entries: List[Json] = []
        for entry_path in _walk(real, recursive):
            if len(entries) >= MAX_LIST_ENTRIES:
                return entries, True
            try:
                entries.append(self._entry(entry_path, os.lstat(entry_path)))
            except OSError:
                continue
        return entries, False


def _walk(top: str, recursive: bool) -> Iterable[str]:
    pending = [top]
    while pending:
        current = pending.pop()
        try:
            with os.scandir(current) as it:
                found = sorted(it, key=lambda e: e.name)
        except OSError:
            continue
        subdirs = []
        for entry in found:
            yield entry.path
            if recursive and entry.is_dir(follow_symlinks=False):
                subdirs.append(entry.path)
        pending.extend(reversed(subdirs))


def _write_file(real: str, data: bytes, mode: Optional[int], append: bool, parents: bool, shown: str) -> int:
    parent = os.path.dirname(real)
    try:
        if parents:
            _makedirs(parent)
        if append:
            fd = os.open(real, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644 if mode is None else mode)
            try:
                _write_all(fd, data)
                if mode is not None:
                    os.fchmod(fd, mode)
                os.fsync(fd)
                return os.fstat(fd).st_size
            finally:
                os.close(fd)
        try:
            existing = os.stat(real)
        except FileNotFoundError:
            existing = None
        if existing is not None and stat.S_ISDIR(existing.st_mode):
            raise OpError("failed_precondition", "%s is a directory" % shown)
        final_mode = mode if mode is not None else (stat.S_IMODE(existing.st_mode) if existing is not None else 0o644)
        tmp = os.path.join(parent, ".%s.%s.berth-tmp" % (os.path.basename(real)[:200], os.urandom(6).hex()))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            try:
                _write_all(fd, data)
                os.fchmod(fd, final_mode)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, real)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        _fsync_dir(parent)
        return len(data)
    except OSError as exc:
        raise _os_error(exc, shown) from None


def _makedirs(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)`` without its recursion (one frame
    per missing directory), so a deep path cannot exhaust the stack."""
    missing = []
    current = path
    while not os.path.isdir(current):
        missing.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory)
        except FileExistsError:
            if not os.path.isdir(directory):
                raise


def _rmtree(top: str) -> None:
    """``shutil.rmtree`` without its recursion (one frame per level): the
    tree below a workspace path may be as deep as its commands made it.
    Symlinks are removed, never followed."""
    pending = [(top, False)]
    while pending:
        current, emptied = pending.pop()
        if emptied:
            os.rmdir(current)
            continue
        pending.append((current, True))
        with os.scandir(current) as it:
            for entry in it:
                if entry.is_dir(follow_symlinks=False):
                    pending.append((entry.path, False))
                else:
                    os.unlink(entry.path)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_for_read(real: str, shown: str) -> Tuple[int, int]:
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise _os_error(exc, shown) from None
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode):
        os.close(fd)
        raise OpError("failed_precondition", "%s is a directory" % shown)
    return fd, st.st_size


def _remove(real: str, recursive: bool, shown: str) -> None:
    try:
        st = os.lstat(real)
        if stat.S_ISDIR(st.st_mode):
            if recursive:
                _rmtree(real)
            else:
                os.rmdir(real)
        else:
            os.unlink(real)
    except OSError as exc:
        raise _os_error(exc, shown) from None
