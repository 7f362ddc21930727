"""The sealed secret substitutions of a sandbox's egress proxy.

Revision ID: sandbox_0002
Revises: sandbox_0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "sandbox_0002"
down_revision = "sandbox_0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.add_column(sa.Column("secrets_ciphertext", sa.LargeBinary, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.drop_column("secrets_ciphertext")
