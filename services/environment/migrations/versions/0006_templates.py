"""Environment service: environment templates.

Revision ID: environment_0006
Revises: environment_0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "environment_0006"
down_revision = "environment_0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "environment_templates",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("org_id", sa.String(128), nullable=False),
        sa.Column("name", sa.Text(), nullable=True),
        sa.Column("config", sa.LargeBinary(), nullable=False),
        sa.Column("create_time", sa.Float(), nullable=False),
        sa.Column("update_time", sa.Float(), nullable=False),
    )
    op.create_index("ix_environment_templates_org_id_id", "environment_templates", ["org_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_environment_templates_org_id_id", table_name="environment_templates")
    op.drop_table("environment_templates")
