"""Artifacts: immutable copies of a session's output files, published when a
turn completes, stored content-addressed under ``<data_dir>/artifacts``.

Publication reads the session's output directory through the Environment
service (``ListSessionOutputs`` + ``ReadWorkspaceFile``) and publishes only
files that are new or changed since the session's previous publication (by
path and SHA-256). Blobs are written before the completing transaction and
referenced by artifact rows inside it; a blob no row references is removed.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from berth.common.v1 import common_pb2
from services.core.ids import new_id
from services.core.logging import get_logger
from services.session.environment_client import EnvironmentClient, SessionOutputs
from services.session.models import ArtifactRow, PublishedOutputRow

__all__ = ["BlobStore", "OutputFile", "published_state", "collect_outputs", "record_publication"]

log = get_logger(__name__)

_CHUNK = 64 * 1024


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, sha256: str) -> Path:
        return self.root / sha256[:2] / sha256

    async def put(self, chunks: AsyncIterator[bytes]) -> tuple[str, int]:
        """Stores a stream; returns (sha256, size). Identical content is stored once."""
        digest = hashlib.sha256()
        size = 0
        fd, tmp_name = tempfile.mkstemp(prefix=".incoming-", dir=self.root)
        try:
            with os.fdopen(fd, "wb") as tmp:
                async for chunk in chunks:
                    digest.update(chunk)
                    size += len(chunk)
                    tmp.write(chunk)
            sha = digest.hexdigest()
            target = self.path(sha)
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists():
                os.unlink(tmp_name)
            else:
                os.replace(tmp_name, target)
            return sha, size
        except BaseException:
            if os.path.exists(tmp_name):
                os.unlink(tmp_name)
            raise

    async def read(self, sha256: str) -> AsyncIterator[bytes]:
        with self.path(sha256).open("rb") as handle:
            while True:
                chunk = await asyncio.to_thread(handle.read, _CHUNK)
                if not chunk:
                    return
                yield chunk

    def delete(self, shas: list[str]) -> None:
        for sha in shas:
            try:
                self.path(sha).unlink()
            except FileNotFoundError:
                pass


@dataclass(frozen=True)
class OutputFile:
    """One output file that is new or changed; ``publish`` is False when only
    its size/mtime moved but its content is what was published before."""

    path: str
    sha256: str
    size_bytes: int
    mtime: float
    publish: bool


async def published_state(s: AsyncSession, session_id: str) -> dict[str, PublishedOutputRow]:
    rows = (await s.execute(select(PublishedOutputRow).where(PublishedOutputRow.session_id == session_id))).scalars()
    return {r.path: r for r in rows}


async def collect_outputs(
    env: EnvironmentClient,
    blobs: BlobStore,
    previous: Callable[[], Awaitable[dict[str, PublishedOutputRow]]],
    outputs: SessionOutputs,
    *,
    environment_id: str,
) -> list[OutputFile]:
    """Reads the new or changed files of ``outputs`` (the session's, as
    ``list_session_outputs`` gave them) into the blob store (no transaction
    is held meanwhile). ``previous`` loads the session's publication state;
    it is only read when there are output files."""
    entries = [e for e in outputs.entries if e.type == common_pb2.FILE_TYPE_FILE]
    if not entries:
        return []
    published = await previous()
    files: list[OutputFile] = []
    for entry in entries:
        # Published under the original absolute path in the environment, as
        # SessionArtifact.path documents.
        path = entry.path
        known = published.get(path)
        if known is not None and known.size_bytes == entry.size_bytes and known.mtime == entry.mtime:
            continue
        sha, size = await blobs.put(env.read_file_chunks(environment_id, entry.path))
        publish = known is None or known.sha256 != sha
        files.append(OutputFile(path, sha, size, entry.mtime, publish))
    return files


async def record_publication(
    s: AsyncSession,
    files: list[OutputFile],
    *,
    org_id: str,
    session_id: str,
    turn_id: str,
    environment_id: str,
) -> list[ArtifactRow]:
    """Inside the completing transaction: artifact rows plus the session's
    publication state."""
    now = time.time()
    rows: list[ArtifactRow] = []
    for f in files:
        await s.merge(PublishedOutputRow(session_id=session_id, path=f.path, sha256=f.sha256, size_bytes=f.size_bytes, mtime=f.mtime))
        if not f.publish:
            continue
        row = ArtifactRow(
            id=new_id("art"),
            org_id=org_id,
            session_id=session_id,
            turn_id=turn_id,
            environment_id=environment_id,
            path=f.path,
            size_bytes=f.size_bytes,
            sha256=f.sha256,
            created_at=now,
        )
        s.add(row)
        rows.append(row)
    return rows
