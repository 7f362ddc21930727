"""Queries on the Environment service's tables.

Functions take an ``AsyncSession`` and never commit; the caller owns the
transaction. Every state change is a compare-and-set (``UPDATE ... WHERE``
the expected state, then check the row count), which behaves the same on
SQLite and PostgreSQL.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Sequence
from typing import Any, NamedTuple, cast

from sqlalchemy import bindparam, delete, false, func, select, true, update
from sqlalchemy.engine import CursorResult
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import defer

from services.core.db import upsert_insert
from services.environment.models import (
    LIFETIME_SHARED,
    BindingRow,
    EnvironmentRow,
    McpServerRow,
    McpServerUseRow,
    RegisteredFileRow,
    SetupStepRow,
    StoredBlobRow,
    StoredFileRow,
    TemplateRow,
)
from services.environment.states import EnvironmentStatus

__all__ = [
    "get_environment",
    "get_environment_by_id",
    "get_environment_config",
    "list_environments",
    "count_environments_by_status",
    "RecordedSandbox",
    "recorded_sandboxes",
    "start_init",
    "renew_lease",
    "finish_init",
    "revert_init",
    "take_over_init",
    "release_lease",
    "ExpiredInit",
    "expired_inits",
    "mark_sandbox_requested",
    "replace_sandbox",
    "done_steps",
    "record_step",
    "attach_reference",
    "get_binding",
    "list_bindings",
    "remove_binding",
    "mark_deleting",
    "clear_deleting",
    "delete_environment_rows",
    "upsert_registered_file",
    "registered_files_by_path",
    "get_stored_file",
    "list_stored_files",
    "delete_stored_file",
    "acquire_blob",
    "release_blob",
    "claim_mcp_server",
    "register_mcp_server",
    "record_mcp_use",
    "list_mcp_servers",
    "list_mcp_uses",
    "mcp_labels_used_by",
    "remove_mcp_uses",
    "get_template",
    "list_templates",
    "update_template",
    "delete_template",
]


def _rowcount(result: Any) -> int:
    return int(cast(CursorResult[Any], result).rowcount)


def _insert(session: AsyncSession, table: Any) -> Any:
    return upsert_insert(session.get_bind().dialect.name, table)


# Environments ---------------------------------------------------------------


def _select_environment(with_config: bool) -> Any:
    stmt = select(EnvironmentRow)
    if not with_config:
        # The configuration can hold megabytes of inline files; hot paths skip it.
        stmt = stmt.options(defer(EnvironmentRow.config, raiseload=True))
    return stmt


async def get_environment(
    session: AsyncSession, environment_id: str, org_id: str, *, with_config: bool = False
) -> EnvironmentRow | None:
    """The organization's environment, unless absent or being deleted."""
    stmt = _get_environment(with_config)
    found = await session.execute(stmt, {"environment_id": environment_id, "org_id": org_id})
    return cast(EnvironmentRow | None, found.scalar_one_or_none())


@functools.cache
def _get_environment(with_config: bool) -> Any:
    # Built once per shape: building a statement costs more than running it.
    return _select_environment(with_config).where(
        EnvironmentRow.id == bindparam("environment_id"),
        EnvironmentRow.org_id == bindparam("org_id"),
        EnvironmentRow.deleting == false(),
    )


async def get_environment_by_id(session: AsyncSession, environment_id: str) -> EnvironmentRow | None:
    stmt = _select_environment(False).where(EnvironmentRow.id == environment_id)
    return cast(EnvironmentRow | None, (await session.execute(stmt)).scalar_one_or_none())


async def get_environment_config(session: AsyncSession, environment_id: str) -> bytes:
    stmt = select(EnvironmentRow.config).where(EnvironmentRow.id == environment_id)
    return bytes((await session.execute(stmt)).scalar_one())


async def list_environments(
    session: AsyncSession, org_id: str, *, after: str, ascending: bool, limit: int
) -> Sequence[EnvironmentRow]:
    stmt = _select_environment(True).where(EnvironmentRow.org_id == org_id, EnvironmentRow.deleting == false())
    if after:
        stmt = stmt.where(EnvironmentRow.id > after if ascending else EnvironmentRow.id < after)
    stmt = stmt.order_by(EnvironmentRow.id.asc() if ascending else EnvironmentRow.id.desc()).limit(limit)
    return (await session.execute(stmt)).scalars().all()


async def sandboxed_environments(session: AsyncSession, org_id: str) -> Sequence[EnvironmentRow]:
    """The organization's environments for which a sandbox was requested,
    being deleted or not (a sandbox that outlives a failed delete still
    substitutes secrets), without their configuration."""
    stmt = _select_environment(False).where(
        EnvironmentRow.org_id == org_id, EnvironmentRow.sandbox_requested == true()
    )
    return (await session.execute(stmt.order_by(EnvironmentRow.id.asc()))).scalars().all()


async def count_environments_by_status(session: AsyncSession) -> dict[str, int]:
    """Environments of every organization by status (for the metrics gauge)."""
    stmt = (
        select(EnvironmentRow.status, func.count())
        .where(EnvironmentRow.deleting == false())
        .group_by(EnvironmentRow.status)
    )
    return {str(status): int(count) for status, count in (await session.execute(stmt)).all()}


class RecordedSandbox(NamedTuple):
    """What an environment's row says about its sandbox (for the sandbox reconciler)."""

    org_id: str
    sandbox_id: str
    sandbox_node: str
    status: str


async def recorded_sandboxes(session: AsyncSession, environment_ids: Collection[str]) -> dict[str, RecordedSandbox]:
    """The organization, sandbox, node and status of each of these
    environments that has a row, being deleted or not."""
    if not environment_ids:
        return {}
    stmt = select(
        EnvironmentRow.id, EnvironmentRow.org_id, EnvironmentRow.sandbox_id, EnvironmentRow.sandbox_node, EnvironmentRow.status
    ).where(EnvironmentRow.id.in_(list(environment_ids)))
    return {
        str(env_id): RecordedSandbox(str(org_id), str(sandbox_id), str(node), str(status))
        for env_id, org_id, sandbox_id, node, status in (await session.execute(stmt)).all()
    }


async def start_init(
    session: AsyncSession, environment_id: str, *, version: int, owner: str, lease_expires_at: float, now: float
) -> bool:
    """CAS ``pending -> initializing``; exactly one caller gets True."""
    result = await session.execute(
        update(EnvironmentRow)
        .where(
            EnvironmentRow.id == environment_id,
            EnvironmentRow.status == EnvironmentStatus.PENDING,
            EnvironmentRow.init_version == version,
            EnvironmentRow.deleting == false(),
        )
        .values(
            status=EnvironmentStatus.INITIALIZING,
            init_version=version + 1,
            lease_owner=owner,
            lease_expires_at=lease_expires_at,
            update_time=now,
        )
    )
    return _rowcount(result) == 1


def _fenced(environment_id: str, version: int, owner: str) -> Any:
    return (
        EnvironmentRow.id == environment_id,
        EnvironmentRow.status == EnvironmentStatus.INITIALIZING,
        EnvironmentRow.init_version == version,
        EnvironmentRow.lease_owner == owner,
    )


async def renew_lease(
    session: AsyncSession, environment_id: str, *, version: int, owner: str, lease_expires_at: float
) -> bool:
    result = await session.execute(
        update(EnvironmentRow).where(*_fenced(environment_id, version, owner)).values(lease_expires_at=lease_expires_at)
    )
    return _rowcount(result) == 1


async def mark_sandbox_requested(
    session: AsyncSession, environment_id: str, *, version: int, owner: str, node: str
) -> bool:
    """Records, fenced, that CreateSandbox is about to run and on which node:
    every later call routes there, from any replica."""
    result = await session.execute(
        update(EnvironmentRow)
        .where(*_fenced(environment_id, version, owner))
        .values(sandbox_requested=True, sandbox_node=node)
    )
    return _rowcount(result) == 1


async def finish_init(
    session: AsyncSession,
    environment_id: str,
    *,
    version: int,
    owner: str,
    status: str,
    error_code: str,
    error_message: str,
    now: float,
) -> bool:
    """CAS ``initializing -> ready|failed``, fenced by version and lease owner."""
    result = await session.execute(
        update(EnvironmentRow)
        .where(*_fenced(environment_id, version, owner))
        .values(
            status=status,
            init_version=version + 1,
            error_code=error_code,
            error_message=error_message,
            lease_owner="",
            lease_expires_at=0.0,
            update_time=now,
        )
    )
    return _rowcount(result) == 1


async def revert_init(session: AsyncSession, environment_id: str, *, version: int, owner: str, now: float) -> bool:
    """CAS ``initializing -> pending`` when nothing ran (the sandbox service was unreachable)."""
    result = await session.execute(
        update(EnvironmentRow)
        .where(*_fenced(environment_id, version, owner))
        .values(status=EnvironmentStatus.PENDING, init_version=version + 1, lease_owner="", lease_expires_at=0.0, update_time=now)
    )
    return _rowcount(result) == 1


async def take_over_init(
    session: AsyncSession, environment_id: str, *, version: int, owner: str, lease_expires_at: float, now: float
) -> bool:
    """CAS that makes ``owner`` the owner of a setup whose lease has expired
    (its owner stopped). The new fencing version shuts the old owner out."""
    result = await session.execute(
        update(EnvironmentRow)
        .where(
            EnvironmentRow.id == environment_id,
            EnvironmentRow.status == EnvironmentStatus.INITIALIZING,
            EnvironmentRow.init_version == version,
            EnvironmentRow.lease_expires_at < now,
            EnvironmentRow.deleting == false(),
        )
        .values(init_version=version + 1, lease_owner=owner, lease_expires_at=lease_expires_at, update_time=now)
    )
    return _rowcount(result) == 1


async def release_lease(session: AsyncSession, environment_id: str, *, version: int, owner: str) -> bool:
    """Ends the owner's lease now, fenced, so a peer takes the setup over at
    once; the environment stays initializing."""
    result = await session.execute(
        update(EnvironmentRow).where(*_fenced(environment_id, version, owner)).values(lease_expires_at=0.0)
    )
    return _rowcount(result) == 1


class ExpiredInit(NamedTuple):
    environment_id: str
    org_id: str
    init_version: int


async def expired_inits(session: AsyncSession, *, now: float, limit: int) -> list[ExpiredInit]:
    """Setups of every organization whose owner's lease has expired."""
    stmt = (
        select(EnvironmentRow.id, EnvironmentRow.org_id, EnvironmentRow.init_version)
        .where(
            EnvironmentRow.status == EnvironmentStatus.INITIALIZING,
            EnvironmentRow.lease_expires_at < now,
            EnvironmentRow.deleting == false(),
        )
        .order_by(EnvironmentRow.lease_expires_at)
        .limit(limit)
    )
    return [ExpiredInit(str(i), str(o), int(v)) for i, o, v in (await session.execute(stmt)).all()]


async def replace_sandbox(
    session: AsyncSession, environment_id: str, *, version: int, owner: str, sandbox_id: str, now: float
) -> bool:
    """Fenced: gives the environment a new sandbox identity (the recorded
    one is gone) and empties its setup journal, so setup starts over."""
    result = await session.execute(
        update(EnvironmentRow)
        .where(*_fenced(environment_id, version, owner))
        .values(sandbox_id=sandbox_id, sandbox_requested=False, update_time=now)
    )
    if _rowcount(result) != 1:
        return False
    await session.execute(delete(SetupStepRow).where(SetupStepRow.environment_id == environment_id))
    return True


async def done_steps(session: AsyncSession, environment_id: str) -> set[str]:
    """The setup journal: the steps recorded as done."""
    stmt = select(SetupStepRow.step).where(SetupStepRow.environment_id == environment_id)
    return {str(step) for step in (await session.execute(stmt)).scalars()}


async def record_step(session: AsyncSession, environment_id: str, step: str, *, version: int, owner: str, now: float) -> bool:
    """Records ``step`` as done, fenced by version and lease owner: the
    fenced update locks the row first, so a takeover either precedes the
    record (which then writes nothing) or waits for it."""
    result = await session.execute(
        update(EnvironmentRow).where(*_fenced(environment_id, version, owner)).values(update_time=now)
    )
    if _rowcount(result) != 1:
        return False
    stmt = _insert(session, SetupStepRow).values(environment_id=environment_id, step=step, init_version=version, done_time=now)
    await session.execute(stmt.on_conflict_do_nothing(index_elements=["environment_id", "step"]))
    return True


async def attach_reference(session: AsyncSession, environment_id: str, org_id: str, *, now: float) -> bool:
    """CAS that makes the environment shared for good and counts the new
    session; it loses against a concurrent init start or deletion."""
    result = await session.execute(
        update(EnvironmentRow)
        .where(
            EnvironmentRow.id == environment_id,
            EnvironmentRow.org_id == org_id,
            EnvironmentRow.status != EnvironmentStatus.INITIALIZING,
            EnvironmentRow.deleting == false(),
        )
        .values(
            lifetime=LIFETIME_SHARED,
            ever_shared=True,
            session_count=EnvironmentRow.session_count + 1,
            update_time=now,
        )
    )
    return _rowcount(result) == 1


async def mark_deleting(
    session: AsyncSession, environment_id: str, org_id: str, *, require_unbound: bool, require_never_shared: bool
) -> bool:
    conditions: list[Any] = [
        EnvironmentRow.id == environment_id,
        EnvironmentRow.org_id == org_id,
        EnvironmentRow.status != EnvironmentStatus.INITIALIZING,
        EnvironmentRow.deleting == false(),
    ]
    if require_unbound:
        conditions.append(EnvironmentRow.session_count == 0)
    if require_never_shared:
        conditions.append(EnvironmentRow.ever_shared == false())
    result = await session.execute(update(EnvironmentRow).where(*conditions).values(deleting=True))
    return _rowcount(result) == 1


async def clear_deleting(session: AsyncSession, environment_id: str) -> None:
    await session.execute(update(EnvironmentRow).where(EnvironmentRow.id == environment_id).values(deleting=False))


async def delete_environment_rows(session: AsyncSession, environment_id: str) -> None:
    await session.execute(delete(McpServerUseRow).where(McpServerUseRow.environment_id == environment_id))
    await session.execute(delete(McpServerRow).where(McpServerRow.environment_id == environment_id))
    await session.execute(delete(RegisteredFileRow).where(RegisteredFileRow.environment_id == environment_id))
    await session.execute(delete(SetupStepRow).where(SetupStepRow.environment_id == environment_id))
    await session.execute(delete(BindingRow).where(BindingRow.environment_id == environment_id))
    await session.execute(delete(EnvironmentRow).where(EnvironmentRow.id == environment_id))


# Bindings -------------------------------------------------------------------


_GET_BINDING = select(BindingRow).where(
    BindingRow.environment_id == bindparam("environment_id"), BindingRow.session_id == bindparam("session_id")
)


async def get_binding(session: AsyncSession, environment_id: str, session_id: str) -> BindingRow | None:
    found = await session.execute(_GET_BINDING, {"environment_id": environment_id, "session_id": session_id})
    return found.scalar_one_or_none()


async def list_bindings(session: AsyncSession, environment_id: str) -> Sequence[BindingRow]:
    stmt = select(BindingRow).where(BindingRow.environment_id == environment_id).order_by(BindingRow.create_time)
    return (await session.execute(stmt)).scalars().all()


async def remove_binding(session: AsyncSession, environment_id: str, session_id: str, *, now: float) -> bool:
    result = await session.execute(
        delete(BindingRow).where(BindingRow.environment_id == environment_id, BindingRow.session_id == session_id)
    )
    if _rowcount(result) != 1:
        return False
    await session.execute(
        update(EnvironmentRow)
        .where(EnvironmentRow.id == environment_id)
        .values(session_count=EnvironmentRow.session_count - 1, update_time=now)
    )
    return True


# Registered files -----------------------------------------------------------


async def upsert_registered_file(session: AsyncSession, row: RegisteredFileRow) -> RegisteredFileRow:
    """Registers ``row.path``; an existing registration keeps its ID."""
    values = {
        "environment_id": row.environment_id,
        "path": row.path,
        "id": row.id,
        "source": row.source,
        "file_id": row.file_id,
        "size_bytes": row.size_bytes,
        "create_time": row.create_time,
    }
    stmt = _insert(session, RegisteredFileRow).values(**values)
    stmt = stmt.on_conflict_do_update(
        index_elements=["environment_id", "path"],
        set_={"source": row.source, "file_id": row.file_id, "size_bytes": row.size_bytes, "create_time": row.create_time},
    )
    await session.execute(stmt)
    stored = (
        await session.execute(
            select(RegisteredFileRow).where(
                RegisteredFileRow.environment_id == row.environment_id, RegisteredFileRow.path == row.path
            )
        )
    ).scalar_one()
    return stored


async def registered_files_by_path(session: AsyncSession, environment_id: str) -> dict[str, RegisteredFileRow]:
    rows = (
        await session.execute(select(RegisteredFileRow).where(RegisteredFileRow.environment_id == environment_id))
    ).scalars()
    return {r.path: r for r in rows}


# Stored files ---------------------------------------------------------------


async def get_stored_file(session: AsyncSession, file_id: str, org_id: str, *, now: float) -> StoredFileRow | None:
    row = (
        await session.execute(select(StoredFileRow).where(StoredFileRow.id == file_id, StoredFileRow.org_id == org_id))
    ).scalar_one_or_none()
    if row is None or (row.expire_time is not None and row.expire_time <= now):
        return None
    return row


async def list_stored_files(
    session: AsyncSession, org_id: str, *, after: str, purpose: str, limit: int, now: float
) -> Sequence[StoredFileRow]:
    stmt = select(StoredFileRow).where(StoredFileRow.org_id == org_id)
    stmt = stmt.where((StoredFileRow.expire_time.is_(None)) | (StoredFileRow.expire_time > now))
    if purpose:
        stmt = stmt.where(StoredFileRow.purpose == purpose)
    if after:
        stmt = stmt.where(StoredFileRow.id < after)
    stmt = stmt.order_by(StoredFileRow.id.desc()).limit(limit)
    return (await session.execute(stmt)).scalars().all()


async def delete_stored_file(session: AsyncSession, file_id: str, org_id: str) -> StoredFileRow | None:
    row = (
        await session.execute(select(StoredFileRow).where(StoredFileRow.id == file_id, StoredFileRow.org_id == org_id))
    ).scalar_one_or_none()
    if row is None:
        return None
    result = await session.execute(delete(StoredFileRow).where(StoredFileRow.id == file_id))
    return row if _rowcount(result) == 1 else None


async def acquire_blob(session: AsyncSession, sha256: str, size_bytes: int) -> None:
    """Counts one more reference to a blob; holds the blob row's lock until
    the transaction ends."""
    stmt = _insert(session, StoredBlobRow).values(sha256=sha256, size_bytes=size_bytes, ref_count=1)
    stmt = stmt.on_conflict_do_update(index_elements=["sha256"], set_={"ref_count": StoredBlobRow.ref_count + 1})
    await session.execute(stmt)


async def release_blob(session: AsyncSession, sha256: str) -> bool:
    """Drops one reference; True when it was the last (the row is gone and
    the caller unlinks the blob before committing)."""
    await session.execute(
        update(StoredBlobRow).where(StoredBlobRow.sha256 == sha256).values(ref_count=StoredBlobRow.ref_count - 1)
    )
    result = await session.execute(
        delete(StoredBlobRow).where(StoredBlobRow.sha256 == sha256, StoredBlobRow.ref_count <= 0)
    )
    return _rowcount(result) == 1


# MCP label registry -----------------------------------------------------------


def _mcp_values(row: McpServerRow) -> dict[str, Any]:
    return {
        "environment_id": row.environment_id,
        "label": row.label,
        "org_id": row.org_id,
        "origin": row.origin,
        "transport_type": row.transport_type,
        "owner_session_id": row.owner_session_id,
        "create_time": row.create_time,
    }


async def claim_mcp_server(session: AsyncSession, row: McpServerRow) -> None:
    """Records ``row`` as the label's owner: the caller's start created the
    sandbox's broker, which makes its configuration the one that runs. It
    replaces a placeholder a concurrent joiner may have written first."""
    stmt = _insert(session, McpServerRow).values(**_mcp_values(row))
    stmt = stmt.on_conflict_do_update(
        index_elements=["environment_id", "label"],
        set_={"owner_session_id": row.owner_session_id, "transport_type": row.transport_type, "create_time": row.create_time},
    )
    await session.execute(stmt)


async def register_mcp_server(session: AsyncSession, row: McpServerRow) -> None:
    """Inserts the label unless it is registered already (a joiner's view)."""
    stmt = _insert(session, McpServerRow).values(**_mcp_values(row))
    await session.execute(stmt.on_conflict_do_nothing(index_elements=["environment_id", "label"]))


async def record_mcp_use(session: AsyncSession, environment_id: str, label: str, session_id: str, *, now: float) -> None:
    stmt = _insert(session, McpServerUseRow).values(
        environment_id=environment_id, label=label, session_id=session_id, create_time=now
    )
    await session.execute(stmt.on_conflict_do_nothing(index_elements=["environment_id", "label", "session_id"]))


async def list_mcp_servers(session: AsyncSession, environment_id: str) -> Sequence[McpServerRow]:
    stmt = (
        select(McpServerRow)
        .where(McpServerRow.environment_id == environment_id)
        .order_by(McpServerRow.create_time, McpServerRow.label)
    )
    return (await session.execute(stmt)).scalars().all()


async def list_mcp_uses(session: AsyncSession, environment_id: str) -> Sequence[McpServerUseRow]:
    stmt = (
        select(McpServerUseRow)
        .where(McpServerUseRow.environment_id == environment_id)
        .order_by(McpServerUseRow.create_time, McpServerUseRow.session_id)
    )
    return (await session.execute(stmt)).scalars().all()


async def mcp_labels_used_by(
    session: AsyncSession, environment_id: str, session_id: str, *, transport_type: str
) -> list[str]:
    stmt = (
        select(McpServerUseRow.label)
        .join(
            McpServerRow,
            (McpServerRow.environment_id == McpServerUseRow.environment_id) & (McpServerRow.label == McpServerUseRow.label),
        )
        .where(
            McpServerUseRow.environment_id == environment_id,
            McpServerUseRow.session_id == session_id,
            McpServerRow.transport_type == transport_type,
        )
        .order_by(McpServerUseRow.label)
    )
    return [str(label) for label in (await session.execute(stmt)).scalars()]


async def remove_mcp_uses(session: AsyncSession, environment_id: str, session_id: str) -> None:
    await session.execute(
        delete(McpServerUseRow).where(
            McpServerUseRow.environment_id == environment_id, McpServerUseRow.session_id == session_id
        )
    )


# Templates ----------------------------------------------------------------------


async def get_template(
    session: AsyncSession, template_id: str, org_id: str, *, for_update: bool = False
) -> TemplateRow | None:
    """A template of the organization; ``for_update`` locks its row (PostgreSQL)
    so a concurrent update cannot lose this one's fields."""
    stmt = select(TemplateRow).where(TemplateRow.id == template_id, TemplateRow.org_id == org_id)
    if for_update:
        stmt = stmt.with_for_update()
    return (await session.execute(stmt)).scalar_one_or_none()


async def list_templates(
    session: AsyncSession, org_id: str, *, after: str, ascending: bool, limit: int
) -> Sequence[TemplateRow]:
    stmt = select(TemplateRow).where(TemplateRow.org_id == org_id)
    if after:
        stmt = stmt.where(TemplateRow.id > after if ascending else TemplateRow.id < after)
    stmt = stmt.order_by(TemplateRow.id.asc() if ascending else TemplateRow.id.desc()).limit(limit)
    return (await session.execute(stmt)).scalars().all()


async def update_template(
    session: AsyncSession, template_id: str, org_id: str, *, config: bytes, name: str | None, update_time: float
) -> bool:
    stmt = (
        update(TemplateRow)
        .where(TemplateRow.id == template_id, TemplateRow.org_id == org_id)
        .values(config=config, name=name, update_time=update_time)
    )
    result = cast(CursorResult[Any], await session.execute(stmt))
    return result.rowcount == 1


async def delete_template(session: AsyncSession, template_id: str, org_id: str) -> bool:
    stmt = delete(TemplateRow).where(TemplateRow.id == template_id, TemplateRow.org_id == org_id)
    result = cast(CursorResult[Any], await session.execute(stmt))
    return result.rowcount == 1
