"""SQLAlchemy models of the Session service's own database.

Every table keeps an integer ``pk`` in insertion order next to its public ID:
IDs sort by millisecond, and two rows created in the same millisecond must
still list in creation order, so cursors resolve to ``pk``.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Boolean, Float, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = [
    "Base",
    "AgentRow",
    "SessionRow",
    "TurnRow",
    "ItemRow",
    "FunctionCallRow",
    "EventRow",
    "ArtifactRow",
    "PublishedOutputRow",
]

# SQLite only auto-increments an INTEGER PRIMARY KEY (the rowid alias).
_PK = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    pass


class AgentRow(Base):
    __tablename__ = "agents"

    pk: Mapped[int] = mapped_column(_PK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    org_id: Mapped[str] = mapped_column(String(128), index=True)
    name: Mapped[str | None] = mapped_column(Text, nullable=True)
    # Normalized configuration (model, instructions, tools, ...), see agents.py.
    config_json: Mapped[str] = mapped_column(Text)
    metadata_json: Mapped[str] = mapped_column(Text)
    version: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


class SessionRow(Base):
    __tablename__ = "sessions"

    pk: Mapped[int] = mapped_column(_PK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    org_id: Mapped[str] = mapped_column(String(128), index=True)
    agent_id: Mapped[str] = mapped_column(String(64), index=True)
    # The resolved agent snapshot, including credentials that are never echoed.
    agent_config_json: Mapped[str] = mapped_column(Text)
    environment_kind: Mapped[str] = mapped_column(String(16))  # "none" | "hosted"
    environment_id: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(24))  # idle | in_progress | requires_action | failed
    error: Mapped[str] = mapped_column(Text)
    metadata_json: Mapped[str] = mapped_column(Text)
    vault_ids_json: Mapped[str] = mapped_column(Text)
    usage_json: Mapped[str] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float)
    last_active_at: Mapped[float] = mapped_column(Float)
    # Last allocated event sequence number: the per-session counter row.
    event_seq: Mapped[int] = mapped_column(BigInteger)
    # The one turn that may run (in_progress or waiting); the per-session mutex.
    active_turn_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # The oldest item the model still sees after the last compaction (0: all).
    context_from_pk: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")


class TurnRow(Base):
    __tablename__ = "turns"

    pk: Mapped[int] = mapped_column(_PK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    session_id: Mapped[str] = mapped_column(String(64), index=True)
    org_id: Mapped[str] = mapped_column(String(128))
    agent_id: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    completed_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    error_code: Mapped[str] = mapped_column(String(64))
    error_message: Mapped[str] = mapped_column(Text)
    usage_json: Mapped[str] = mapped_column(Text)
    cancel_requested: Mapped[bool] = mapped_column(Boolean)
    worker_id: Mapped[str] = mapped_column(String(64))
    lease_expires_at: Mapped[float] = mapped_column(Float)
    # The user messages (lists of content parts) that become items when the turn starts.
    input_json: Mapped[str] = mapped_column(Text)
    # Output items the turn produced: the next output_index. The worker running
    # the turn counts in memory and records the total when the turn ends.
    next_output_index: Mapped[int] = mapped_column(Integer)


class ItemRow(Base):
    __tablename__ = "items"

    pk: Mapped[int] = mapped_column(_PK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    session_id: Mapped[str] = mapped_column(String(64), index=True)
    turn_id: Mapped[str] = mapped_column(String(64), index=True)
    type: Mapped[str] = mapped_column(String(48))
    item_json: Mapped[str] = mapped_column(Text)
    # What the model saw for this item (harness transcript entries), JSON list.
    model_json: Mapped[str] = mapped_column(Text)
    # Hidden items only feed the model transcript (e.g. a call to an unknown tool).
    visible: Mapped[bool] = mapped_column(Boolean)
    created_at: Mapped[float] = mapped_column(Float)


class FunctionCallRow(Base):
    """A pending or answered application function call. ``call_id`` is ours,
    not the model's, so it is unique across sessions."""

    __tablename__ = "function_calls"

    call_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    session_id: Mapped[str] = mapped_column(String(64), index=True)
    turn_id: Mapped[str] = mapped_column(String(64), index=True)
    item_id: Mapped[str] = mapped_column(String(64))
    name: Mapped[str] = mapped_column(Text)
    arguments: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16))  # pending | answered | consumed | cancelled
    success: Mapped[bool] = mapped_column(Boolean)
    output_json: Mapped[str] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)


class EventRow(Base):
    __tablename__ = "events"

    session_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    type: Mapped[str] = mapped_column(String(80))
    turn_id: Mapped[str] = mapped_column(String(64))
    event_json: Mapped[str] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float)


class ArtifactRow(Base):
    __tablename__ = "artifacts"

    pk: Mapped[int] = mapped_column(_PK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    org_id: Mapped[str] = mapped_column(String(128))
    session_id: Mapped[str] = mapped_column(String(64), index=True)
    turn_id: Mapped[str] = mapped_column(String(64))
    environment_id: Mapped[str] = mapped_column(String(64))
    path: Mapped[str] = mapped_column(Text)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64), index=True)
    created_at: Mapped[float] = mapped_column(Float)


class PublishedOutputRow(Base):
    """What a session last published per output path, so a turn publishes only
    new or changed files even after the artifact itself was deleted."""

    __tablename__ = "published_outputs"

    session_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    path: Mapped[str] = mapped_column(String(1024), primary_key=True)
    sha256: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    mtime: Mapped[float] = mapped_column(Float)


class TraceRow(Base):
    """The published trace of one root turn (its ID is the turn's)."""

    __tablename__ = "traces"

    pk: Mapped[int] = mapped_column(_PK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    org_id: Mapped[str] = mapped_column(String(128))
    session_id: Mapped[str] = mapped_column(String(64), index=True)
    # Creation time of the root turn.
    created_at: Mapped[float] = mapped_column(Float)
    otlp_json: Mapped[str] = mapped_column(Text)
