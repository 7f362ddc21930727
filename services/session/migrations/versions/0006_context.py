"""Session service: the traces of root turns, and where a session's
history starts for the model after its last compaction.

Revision ID: session_0006
Revises: session_0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "session_0006"
down_revision = "session_0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "traces",
        sa.Column("pk", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(64), nullable=False, unique=True),
        sa.Column("org_id", sa.String(128), nullable=False),
        sa.Column("session_id", sa.String(64), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("otlp_json", sa.Text(), nullable=False),
    )
    op.create_index("ix_traces_session_id", "traces", ["session_id"])
    op.add_column("sessions", sa.Column("context_from_pk", sa.BigInteger(), nullable=False, server_default="0"))


def downgrade() -> None:
    op.drop_column("sessions", "context_from_pk")
    op.drop_index("ix_traces_session_id", table_name="traces")
    op.drop_table("traces")
