"""The organization file store behind the OpenAI Files API.

Content lives in content-addressed blobs under ``<data_dir>/blobs/<sha[:2]>/<sha>``,
written atomically; metadata rows are per organization. A reference count
row per blob serializes the create that writes a blob with the delete that
unlinks it, so deleting one organization's copy never removes content another
row still uses.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from sqlalchemy.ext.asyncio import AsyncSession

from services.core.db import Database
from services.core.errors import InvalidArgument, NotFound
from services.core.ids import has_prefix, new_id
from services.environment import repository as repo
from services.environment.models import StoredFileRow

__all__ = ["FileStore", "CHUNK_BYTES"]

CHUNK_BYTES = 1024 * 1024
_MAX_LIST = 10_000


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _ensure_blob(path: Path, data: bytes) -> None:
    if path.exists() and path.stat().st_size == len(data):
        return
    _write_atomic(path, data)


class FileStore:
    def __init__(self, db: Database, root: Path, *, max_bytes: int) -> None:
        self._db = db
        self._root = root
        self._max_bytes = max_bytes

    def _blob_path(self, sha256: str) -> Path:
        return self._root / sha256[:2] / sha256

    async def create(self, org_id: str, *, filename: str, purpose: str, data: bytes, expires_after_s: int) -> StoredFileRow:
        if len(data) > self._max_bytes:
            raise InvalidArgument(f"file exceeds the maximum size of {self._max_bytes} bytes", param="file")
        if not filename:
            raise InvalidArgument("filename is required", param="file")
        if not purpose:
            raise InvalidArgument("purpose is required", param="purpose")
        if expires_after_s < 0:
            raise InvalidArgument("expires_after must not be negative", param="expires_after")
        sha256 = hashlib.sha256(data).hexdigest()
        now = time.time()
        row = StoredFileRow(
            id=new_id("file"),
            org_id=org_id,
            filename=filename,
            purpose=purpose,
            size_bytes=len(data),
            sha256=sha256,
            create_time=now,
            expire_time=now + expires_after_s if expires_after_s else None,
        )
        async def store(s: AsyncSession) -> None:
            await repo.acquire_blob(s, sha256, len(data))
            # Written while the blob row is locked, so a concurrent last delete
            # cannot unlink it between this write and the commit.
            await asyncio.to_thread(_ensure_blob, self._blob_path(sha256), data)
            s.add(row)

        await self._db.run(store)
        return row

    async def get(self, org_id: str, file_id: str, *, param: str | None = None) -> StoredFileRow:
        if has_prefix(file_id, "file"):
            async with self._db.transaction(read_only=True) as s:
                row = await repo.get_stored_file(s, file_id, org_id, now=time.time())
            if row is not None:
                return row
        raise NotFound(f"file {file_id} not found", param=param)

    async def read(self, org_id: str, file_id: str) -> bytes:
        row = await self.get(org_id, file_id)
        return await asyncio.to_thread(self._blob_path(row.sha256).read_bytes)

    async def chunks(self, org_id: str, file_id: str) -> AsyncIterator[bytes]:
        data = await self.read(org_id, file_id)
        if not data:
            yield b""
        for start in range(0, len(data), CHUNK_BYTES):
            yield data[start : start + CHUNK_BYTES]

    async def delete(self, org_id: str, file_id: str) -> None:
        if not has_prefix(file_id, "file"):
            raise NotFound(f"file {file_id} not found")
        async def remove(s: AsyncSession) -> None:
            row = await repo.delete_stored_file(s, file_id, org_id)
            if row is None:
                raise NotFound(f"file {file_id} not found")
            if await repo.release_blob(s, row.sha256):
                await asyncio.to_thread(self._blob_path(row.sha256).unlink, missing_ok=True)

        await self._db.run(remove)

    async def list(self, org_id: str, *, page_size: int, after: str, purpose: str) -> tuple[Sequence[StoredFileRow], bool]:
        if page_size < 0 or page_size > _MAX_LIST:
            raise InvalidArgument(f"limit must be between 1 and {_MAX_LIST}", param="limit")
        limit = page_size or 20
        async with self._db.transaction(read_only=True) as s:
            rows = await repo.list_stored_files(s, org_id, after=after, purpose=purpose, limit=limit + 1, now=time.time())
        return rows[:limit], len(rows) > limit
