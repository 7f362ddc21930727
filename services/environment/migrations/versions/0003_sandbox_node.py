"""Environment service: the Sandbox service node each sandbox was placed on.

Existing rows get the empty name, which routes to the default node: the one
Sandbox service every sandbox lived on before there were several.

Revision ID: environment_0003
Revises: environment_0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "environment_0003"
down_revision = "environment_0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "environments",
        sa.Column("sandbox_node", sa.String(128), nullable=False, server_default=""),
    )


def downgrade() -> None:
    with op.batch_alter_table("environments") as batch:
        batch.drop_column("sandbox_node")
