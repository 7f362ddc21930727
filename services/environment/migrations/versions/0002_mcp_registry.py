"""Environment service: the MCP label registry and its per-session uses.

Revision ID: environment_0002
Revises: environment_0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "environment_0002"
down_revision = "environment_0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "mcp_servers",
        sa.Column("environment_id", sa.String(64), primary_key=True),
        sa.Column("label", sa.String(128), primary_key=True),
        sa.Column("org_id", sa.String(128), nullable=False),
        sa.Column("origin", sa.String(16), nullable=False),
        sa.Column("transport_type", sa.String(16), nullable=False),
        sa.Column("owner_session_id", sa.String(128), nullable=False),
        sa.Column("create_time", sa.Float(), nullable=False),
    )
    op.create_table(
        "mcp_server_uses",
        sa.Column("environment_id", sa.String(64), primary_key=True),
        sa.Column("label", sa.String(128), primary_key=True),
        sa.Column("session_id", sa.String(128), primary_key=True),
        sa.Column("create_time", sa.Float(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("mcp_server_uses")
    op.drop_table("mcp_servers")
