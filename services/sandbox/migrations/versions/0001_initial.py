"""Sandboxes table.

Revision ID: sandbox_0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "sandbox_0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sandboxes",
        sa.Column("sandbox_id", sa.String(64), primary_key=True),
        sa.Column("org_id", sa.String(64), nullable=False, index=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("backend", sa.String(16), nullable=False),
        sa.Column("isolation", sa.String(16), nullable=False),
        sa.Column("labels_json", sa.Text, nullable=False),
        sa.Column("network_json", sa.Text, nullable=False),
        sa.Column("env_json", sa.Text, nullable=False),
        sa.Column("size", sa.Integer, nullable=False),
        sa.Column("handle_json", sa.Text, nullable=False),
        sa.Column("error", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("last_active_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("sandboxes")
