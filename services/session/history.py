"""A session's turns, items and artifacts, read (and artifacts deleted)
after checking the session belongs to the caller's organization."""

from __future__ import annotations

from collections.abc import AsyncIterator

from sqlalchemy import delete
from sqlalchemy.ext.asyncio import AsyncSession

from services.core.errors import NotFound
from services.session import repository as repo
from services.session.artifacts import BlobStore
from services.session.models import ArtifactRow, ItemRow, TurnRow
from services.session.repository import Page
from services.session.store import Store, Unit

__all__ = ["SessionHistory"]


class SessionHistory:
    def __init__(self, store: Store, blobs: BlobStore) -> None:
        self.store = store
        self.blobs = blobs

    async def list_turns(self, org: str, session_id: str, page: Page) -> tuple[list[TurnRow], bool]:
        async def run(s: AsyncSession) -> tuple[list[TurnRow], bool]:
            await repo.get_session(s, org, session_id)
            return await repo.paginate(s, TurnRow, [TurnRow.session_id == session_id], page)

        return await self.store.query(run)

    async def get_turn(self, org: str, session_id: str, turn_id: str) -> TurnRow:
        async def run(s: AsyncSession) -> TurnRow:
            await repo.get_session(s, org, session_id)
            return await repo.get_turn(s, session_id, turn_id)

        return await self.store.query(run)

    async def list_items(self, org: str, session_id: str, turn_id: str, page: Page) -> tuple[list[ItemRow], bool]:
        async def run(s: AsyncSession) -> tuple[list[ItemRow], bool]:
            await repo.get_session(s, org, session_id)
            scope = [ItemRow.session_id == session_id, ItemRow.visible.is_(True)]
            if turn_id:
                await repo.get_turn(s, session_id, turn_id)
                scope.append(ItemRow.turn_id == turn_id)
            return await repo.paginate(s, ItemRow, scope, page)

        return await self.store.query(run)

    async def list_artifacts(self, org: str, session_id: str, turn_id: str, page: Page) -> tuple[list[ArtifactRow], bool]:
        async def run(s: AsyncSession) -> tuple[list[ArtifactRow], bool]:
            await repo.get_session(s, org, session_id)
            scope = [ArtifactRow.session_id == session_id]
            if turn_id:
                scope.append(ArtifactRow.turn_id == turn_id)
            return await repo.paginate(s, ArtifactRow, scope, page)

        return await self.store.query(run)

    async def get_artifact(self, org: str, session_id: str, artifact_id: str) -> ArtifactRow:
        async def run(s: AsyncSession) -> ArtifactRow:
            await repo.get_session(s, org, session_id)
            return await repo.get_artifact(s, session_id, artifact_id)

        return await self.store.query(run)

    async def artifact_content(self, org: str, session_id: str, artifact_id: str) -> AsyncIterator[bytes]:
        row = await self.get_artifact(org, session_id, artifact_id)
        if not self.blobs.path(row.sha256).exists():
            raise NotFound(f"the content of artifact {artifact_id} is missing", param="artifact_id")
        return self.blobs.read(row.sha256)

    async def delete_artifact(self, org: str, session_id: str, artifact_id: str) -> str:
        async def remove(u: Unit) -> list[str]:
            await repo.get_session(u.session, org, session_id)
            row = await repo.get_artifact(u.session, session_id, artifact_id)
            await u.session.execute(delete(ArtifactRow).where(ArtifactRow.id == artifact_id))
            return await repo.unreferenced_blobs(u.session, [row.sha256])

        self.blobs.delete(await self.store.transact(remove))
        return artifact_id
