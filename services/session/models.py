"""SQLAlchemy models of the Session service's own database.

Every table keeps an integer ``pk`` in insertion order next to its public ID:
IDs sort by millisecond, and two rows created in the same millisecond must
still list in creation order, so cursors resolve to ``pk``.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Boolean, Float, Index, Integer, LargeBinary, String, Text, UniqueConstraint
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
    "SubagentRow",
    "WebhookEndpointRow",
    "WebhookDeliveryRow",
    "WebhookAttemptRow",
    "AutomationRow",
    "InvocationRow",
    "SessionMetadataRow",
    "TraceRow",
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
    # Review, prompt cache TTL and spend budget as set on create or update
    # (services/session/session_controls.py);
    # empty when none is set.
    controls_json: Mapped[str] = mapped_column(Text, default="", server_default="")
    created_at: Mapped[float] = mapped_column(Float)
    last_active_at: Mapped[float] = mapped_column(Float)
    # Last allocated event sequence number: the per-session counter row.
    event_seq: Mapped[int] = mapped_column(BigInteger)
    # The one turn that may run (in_progress or waiting); the per-session mutex.
    active_turn_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # The oldest item the model still sees after the last compaction (0: all).
    context_from_pk: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # The subagent this (child) session runs for; None for a session an
    # application created. Child sessions are not listed as sessions.
    subagent_id: Mapped[str | None] = mapped_column(String(64), nullable=True, default=None)


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
    # The subagent that ran the turn (its session's subagent); None for root turns.
    subagent_id: Mapped[str | None] = mapped_column(String(64), nullable=True, default=None)
    # A subagent turn's place in its root turn's trace (harness/trace.py
    # TraceLink as JSON); empty for a root turn.
    trace_link_json: Mapped[str] = mapped_column(Text, default="", server_default="")


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


class SubagentRow(Base):
    """A subagent a model created: a child session on the parent's
    environment. The root session (the one an application created) owns
    every subagent of its tree."""

    __tablename__ = "subagents"

    pk: Mapped[int] = mapped_column(_PK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    org_id: Mapped[str] = mapped_column(String(128))
    root_session_id: Mapped[str] = mapped_column(String(64), index=True)
    # The session whose model created it (the root or another child).
    parent_session_id: Mapped[str] = mapped_column(String(64), index=True)
    parent_agent_id: Mapped[str] = mapped_column(String(64))
    child_session_id: Mapped[str] = mapped_column(String(64), unique=True)
    name: Mapped[str | None] = mapped_column(Text, nullable=True)
    # The initial task, as output_text content parts.
    instructions_json: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16))  # active | closed
    opened_at: Mapped[float] = mapped_column(Float)
    closed_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class WebhookEndpointRow(Base):
    """An organization's webhook receiver. The signing secret is stored
    encrypted (it must be usable to sign); see webhooks/signing.py."""

    __tablename__ = "webhook_endpoints"

    pk: Mapped[int] = mapped_column(_PK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    org_id: Mapped[str] = mapped_column(String(128), index=True)
    name: Mapped[str] = mapped_column(Text)
    url: Mapped[str] = mapped_column(Text)
    event_types_json: Mapped[str] = mapped_column(Text)
    secret_encrypted: Mapped[str] = mapped_column(Text)
    secret_hint: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16))  # enabled | disabled
    disabled_reason: Mapped[str] = mapped_column(Text)
    consecutive_failures: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


class WebhookDeliveryRow(Base):
    """The durable outbox: one event for one endpoint, written in the
    transaction of the event it announces. A worker claims it by moving
    ``next_attempt_at`` past its claim lease (``claimed_by`` fences the
    result)."""

    __tablename__ = "webhook_deliveries"
    # The worker's claim scans pending deliveries by due time.
    __table_args__ = (Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),)

    pk: Mapped[int] = mapped_column(_PK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    org_id: Mapped[str] = mapped_column(String(128))
    endpoint_id: Mapped[str] = mapped_column(String(64), index=True)
    event_id: Mapped[str] = mapped_column(String(64))
    event_type: Mapped[str] = mapped_column(String(80))
    payload_json: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16))  # pending | delivered | failed
    attempt_count: Mapped[int] = mapped_column(Integer)
    next_attempt_at: Mapped[float] = mapped_column(Float)
    claimed_by: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[float] = mapped_column(Float)
    delivered_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class WebhookAttemptRow(Base):
    """One delivery attempt, kept for the deliveries listing."""

    __tablename__ = "webhook_attempts"

    pk: Mapped[int] = mapped_column(_PK, primary_key=True, autoincrement=True)
    delivery_id: Mapped[str] = mapped_column(String(64), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[float] = mapped_column(Float)
    duration_ms: Mapped[float] = mapped_column(Float)
    status_code: Mapped[int] = mapped_column(Integer)
    error: Mapped[str] = mapped_column(Text)
    success: Mapped[bool] = mapped_column(Boolean)


class AutomationRow(Base):
    __tablename__ = "automations"

    pk: Mapped[int] = mapped_column(_PK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    org_id: Mapped[str] = mapped_column(String(128), index=True)
    name: Mapped[str] = mapped_column(Text)
    kind: Mapped[str] = mapped_column(String(16))  # AutomationKind
    expression: Mapped[str] = mapped_column(Text)
    timezone: Mapped[str] = mapped_column(String(64))
    run_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    status: Mapped[str] = mapped_column(String(16))  # AutomationStatus
    pause_reason: Mapped[str] = mapped_column(String(32))
    creator_session_id: Mapped[str] = mapped_column(String(64))
    creator_tool_call_id: Mapped[str] = mapped_column(String(128))
    # The existing session an existing_session target names ("" otherwise), for list filters.
    target_session_id: Mapped[str] = mapped_column(String(64), index=True)
    # The serialized berth.session.v1.AutomationTarget.
    target_pb: Mapped[bytes] = mapped_column(LargeBinary)
    metadata_json: Mapped[str] = mapped_column(Text)
    # The next occurrence the scheduler fires; null once none is due (paused, completed).
    next_run_at: Mapped[float | None] = mapped_column(Float, nullable=True, index=True)
    # Bumped by every change: the scheduler's compare-and-set fence.
    version: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


class InvocationRow(Base):
    __tablename__ = "automation_invocations"
    # One invocation per scheduled occurrence, whichever replica fires it.
    __table_args__ = (UniqueConstraint("automation_id", "scheduled_at", name="uq_invocation_occurrence"),)

    pk: Mapped[int] = mapped_column(_PK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    org_id: Mapped[str] = mapped_column(String(128))
    automation_id: Mapped[str] = mapped_column(String(64), index=True)
    scheduled_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    status: Mapped[str] = mapped_column(String(16), index=True)  # InvocationStatus
    session_id: Mapped[str] = mapped_column(String(64))
    skip_reason: Mapped[str] = mapped_column(String(32))
    error_code: Mapped[str] = mapped_column(String(64))
    error_message: Mapped[str] = mapped_column(Text)
    # The serialized berth.session.v1.Automation when the occurrence fired; null for manual runs.
    snapshot_pb: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    # A replica delivering the invocation holds it until then.
    lease_until: Mapped[float] = mapped_column(Float)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


class SessionMetadataRow(Base):
    """One metadata pair of a session, kept beside ``metadata_json`` so that
    ``sessions.list(metadata=...)`` filters in SQL on any database."""

    __tablename__ = "session_metadata"
    __table_args__ = (Index("ix_session_metadata_org_key_value", "org_id", "key", "value"),)

    session_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    org_id: Mapped[str] = mapped_column(String(128))
    value: Mapped[str] = mapped_column(String(512))


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
    # For the spans of a subagent's turn: the root turn they are published
    # under (the row's own ID is then the subagent's turn); None for a root turn.
    root_turn_id: Mapped[str | None] = mapped_column(String(64), nullable=True, default=None, index=True)
