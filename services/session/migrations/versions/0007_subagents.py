"""Session service: subagents (child sessions a model created) and the
subagent a session or turn runs for.

Revision ID: session_0007
Revises: session_0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "session_0007"
down_revision = "session_0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "subagents",
        sa.Column("pk", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(64), nullable=False, unique=True),
        sa.Column("org_id", sa.String(128), nullable=False),
        sa.Column("root_session_id", sa.String(64), nullable=False),
        sa.Column("parent_session_id", sa.String(64), nullable=False),
        sa.Column("parent_agent_id", sa.String(64), nullable=False),
        sa.Column("child_session_id", sa.String(64), nullable=False, unique=True),
        sa.Column("name", sa.Text(), nullable=True),
        sa.Column("instructions_json", sa.Text(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("opened_at", sa.Float(), nullable=False),
        sa.Column("closed_at", sa.Float(), nullable=True),
    )
    op.create_index("ix_subagents_root_session_id", "subagents", ["root_session_id"])
    op.create_index("ix_subagents_parent_session_id", "subagents", ["parent_session_id"])
    op.add_column("sessions", sa.Column("subagent_id", sa.String(64), nullable=True))
    op.add_column("turns", sa.Column("subagent_id", sa.String(64), nullable=True))


def downgrade() -> None:
    op.drop_column("turns", "subagent_id")
    op.drop_column("sessions", "subagent_id")
    op.drop_index("ix_subagents_parent_session_id", table_name="subagents")
    op.drop_index("ix_subagents_root_session_id", table_name="subagents")
    op.drop_table("subagents")
