"""Session service: filterable session metadata (one row per pair, filled
from the existing sessions' metadata) and the session controls column.

Revision ID: session_0003
Revises: session_0001
"""

from __future__ import annotations

import json

import sqlalchemy as sa
from alembic import op

revision = "session_0003"
down_revision = "session_0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    metadata = op.create_table(
        "session_metadata",
        sa.Column("session_id", sa.String(64), primary_key=True),
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("org_id", sa.String(128), nullable=False),
        sa.Column("value", sa.String(512), nullable=False),
    )
    op.create_index("ix_session_metadata_org_key_value", "session_metadata", ["org_id", "key", "value"])
    op.add_column("sessions", sa.Column("controls_json", sa.Text(), nullable=False, server_default=""))
    sessions = sa.table("sessions", sa.column("id", sa.String), sa.column("org_id", sa.String), sa.column("metadata_json", sa.Text))
    rows = op.get_bind().execute(sa.select(sessions.c.id, sessions.c.org_id, sessions.c.metadata_json)).all()
    pairs = [
        {"session_id": session_id, "key": k, "org_id": org_id, "value": v}
        for session_id, org_id, raw in rows
        for k, v in (json.loads(raw or "{}") or {}).items()
    ]
    if pairs:
        op.bulk_insert(metadata, pairs)


def downgrade() -> None:
    op.drop_column("sessions", "controls_json")
    op.drop_index("ix_session_metadata_org_key_value", table_name="session_metadata")
    op.drop_table("session_metadata")
