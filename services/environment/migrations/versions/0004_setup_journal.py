"""Environment service: the setup journal, one row per setup step done,
and an index for the sweep that takes over setups whose owner stopped.

Revision ID: environment_0004
Revises: environment_0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "environment_0004"
down_revision = "environment_0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "setup_steps",
        sa.Column("environment_id", sa.String(64), primary_key=True),
        sa.Column("step", sa.String(64), primary_key=True),
        sa.Column("init_version", sa.BigInteger(), nullable=False),
        sa.Column("done_time", sa.Float(), nullable=False),
    )
    op.create_index("ix_environments_status_lease", "environments", ["status", "lease_expires_at"])


def downgrade() -> None:
    op.drop_index("ix_environments_status_lease", table_name="environments")
    op.drop_table("setup_steps")
