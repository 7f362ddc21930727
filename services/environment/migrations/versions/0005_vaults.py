"""Environment service: vaults and their credentials, secrets encrypted.

Revision ID: environment_0005
Revises: environment_0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "environment_0005"
down_revision = "environment_0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "vaults",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("org_id", sa.String(128), nullable=False),
        sa.Column("name", sa.Text(), nullable=True),
        sa.Column("metadata_json", sa.Text(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("create_time", sa.Float(), nullable=False),
        sa.Column("update_time", sa.Float(), nullable=False),
    )
    op.create_index("ix_vaults_org_id", "vaults", ["org_id", "id"])
    op.create_table(
        "vault_credentials",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("org_id", sa.String(128), nullable=False),
        sa.Column("vault_id", sa.String(64), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("metadata_json", sa.Text(), nullable=False),
        sa.Column("auth_type", sa.String(32), nullable=False),
        sa.Column("auth", sa.LargeBinary(), nullable=False),
        sa.Column("secret_ciphertext", sa.LargeBinary(), nullable=False),
        sa.Column("key_id", sa.String(32), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("create_time", sa.Float(), nullable=False),
        sa.Column("update_time", sa.Float(), nullable=False),
    )
    op.create_index("ix_vault_credentials_vault_id", "vault_credentials", ["vault_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_vault_credentials_vault_id", table_name="vault_credentials")
    op.drop_table("vault_credentials")
    op.drop_index("ix_vaults_org_id", table_name="vaults")
    op.drop_table("vaults")
