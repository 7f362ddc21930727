"""Session service: agents, sessions, turns, items, function calls, events, artifacts.

Revision ID: session_0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "session_0001"
down_revision = None
branch_labels = None
depends_on = None


def _pk() -> sa.Column[int]:
    return sa.Column("pk", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True)


def upgrade() -> None:
    op.create_table(
        "agents",
        _pk(),
        sa.Column("id", sa.String(64), nullable=False, unique=True),
        sa.Column("org_id", sa.String(128), nullable=False),
        sa.Column("name", sa.Text(), nullable=True),
        sa.Column("config_json", sa.Text(), nullable=False),
        sa.Column("metadata_json", sa.Text(), nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
    )
    op.create_index("ix_agents_org_id", "agents", ["org_id"])

    op.create_table(
        "sessions",
        _pk(),
        sa.Column("id", sa.String(64), nullable=False, unique=True),
        sa.Column("org_id", sa.String(128), nullable=False),
        sa.Column("agent_id", sa.String(64), nullable=False),
        sa.Column("agent_config_json", sa.Text(), nullable=False),
        sa.Column("environment_kind", sa.String(16), nullable=False),
        sa.Column("environment_id", sa.String(64), nullable=False),
        sa.Column("status", sa.String(24), nullable=False),
        sa.Column("error", sa.Text(), nullable=False),
        sa.Column("metadata_json", sa.Text(), nullable=False),
        sa.Column("vault_ids_json", sa.Text(), nullable=False),
        sa.Column("usage_json", sa.Text(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("last_active_at", sa.Float(), nullable=False),
        sa.Column("event_seq", sa.BigInteger(), nullable=False),
        sa.Column("active_turn_id", sa.String(64), nullable=True),
    )
    op.create_index("ix_sessions_org_id", "sessions", ["org_id"])
    op.create_index("ix_sessions_agent_id", "sessions", ["agent_id"])

    op.create_table(
        "turns",
        _pk(),
        sa.Column("id", sa.String(64), nullable=False, unique=True),
        sa.Column("session_id", sa.String(64), nullable=False),
        sa.Column("org_id", sa.String(128), nullable=False),
        sa.Column("agent_id", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=True),
        sa.Column("completed_at", sa.Float(), nullable=True),
        sa.Column("error_code", sa.String(64), nullable=False),
        sa.Column("error_message", sa.Text(), nullable=False),
        sa.Column("usage_json", sa.Text(), nullable=False),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("worker_id", sa.String(64), nullable=False),
        sa.Column("lease_expires_at", sa.Float(), nullable=False),
        sa.Column("input_json", sa.Text(), nullable=False),
        sa.Column("next_output_index", sa.Integer(), nullable=False),
    )
    op.create_index("ix_turns_session_id", "turns", ["session_id"])
    op.create_index("ix_turns_status", "turns", ["status"])

    op.create_table(
        "items",
        _pk(),
        sa.Column("id", sa.String(64), nullable=False, unique=True),
        sa.Column("session_id", sa.String(64), nullable=False),
        sa.Column("turn_id", sa.String(64), nullable=False),
        sa.Column("type", sa.String(48), nullable=False),
        sa.Column("item_json", sa.Text(), nullable=False),
        sa.Column("model_json", sa.Text(), nullable=False),
        sa.Column("visible", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
    )
    op.create_index("ix_items_session_id", "items", ["session_id"])
    op.create_index("ix_items_turn_id", "items", ["turn_id"])

    op.create_table(
        "function_calls",
        sa.Column("call_id", sa.String(64), primary_key=True),
        sa.Column("session_id", sa.String(64), nullable=False),
        sa.Column("turn_id", sa.String(64), nullable=False),
        sa.Column("item_id", sa.String(64), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("arguments", sa.Text(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("success", sa.Boolean(), nullable=False),
        sa.Column("output_json", sa.Text(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
    )
    op.create_index("ix_function_calls_session_id", "function_calls", ["session_id"])
    op.create_index("ix_function_calls_turn_id", "function_calls", ["turn_id"])

    op.create_table(
        "events",
        sa.Column("session_id", sa.String(64), primary_key=True),
        sa.Column("seq", sa.BigInteger(), primary_key=True),
        sa.Column("type", sa.String(80), nullable=False),
        sa.Column("turn_id", sa.String(64), nullable=False),
        sa.Column("event_json", sa.Text(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
    )

    op.create_table(
        "artifacts",
        _pk(),
        sa.Column("id", sa.String(64), nullable=False, unique=True),
        sa.Column("org_id", sa.String(128), nullable=False),
        sa.Column("session_id", sa.String(64), nullable=False),
        sa.Column("turn_id", sa.String(64), nullable=False),
        sa.Column("environment_id", sa.String(64), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
    )
    op.create_index("ix_artifacts_session_id", "artifacts", ["session_id"])
    op.create_index("ix_artifacts_sha256", "artifacts", ["sha256"])

    op.create_table(
        "published_outputs",
        sa.Column("session_id", sa.String(64), primary_key=True),
        sa.Column("path", sa.String(1024), primary_key=True),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("mtime", sa.Float(), nullable=False),
    )


def downgrade() -> None:
    for table in ("published_outputs", "artifacts", "events", "function_calls", "items", "turns", "sessions", "agents"):
        op.drop_table(table)
