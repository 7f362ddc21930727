"""Session service: subagent turns continue their root turn's trace.

Revision ID: session_0008
Revises: session_0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "session_0008"
down_revision = "session_0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("turns", sa.Column("trace_link_json", sa.Text(), nullable=False, server_default=""))
    op.add_column("traces", sa.Column("root_turn_id", sa.String(64), nullable=True))
    op.create_index("ix_traces_root_turn_id", "traces", ["root_turn_id"])


def downgrade() -> None:
    op.drop_index("ix_traces_root_turn_id", table_name="traces")
    op.drop_column("traces", "root_turn_id")
    op.drop_column("turns", "trace_link_json")
