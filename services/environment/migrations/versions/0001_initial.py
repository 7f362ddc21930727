"""Environment service: environments, bindings, registered and stored files.

Revision ID: environment_0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "environment_0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "environments",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("org_id", sa.String(128), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("lifetime", sa.String(16), nullable=False),
        sa.Column("ever_shared", sa.Boolean(), nullable=False),
        sa.Column("deleting", sa.Boolean(), nullable=False),
        sa.Column("sandbox_id", sa.String(64), nullable=False),
        sa.Column("sandbox_requested", sa.Boolean(), nullable=False),
        sa.Column("config", sa.LargeBinary(), nullable=False),
        sa.Column("vault_ids_json", sa.Text(), nullable=False),
        sa.Column("owner_session_id", sa.String(128), nullable=False),
        sa.Column("session_count", sa.Integer(), nullable=False),
        sa.Column("error_code", sa.String(64), nullable=False),
        sa.Column("error_message", sa.Text(), nullable=False),
        sa.Column("init_version", sa.BigInteger(), nullable=False),
        sa.Column("lease_owner", sa.String(128), nullable=False),
        sa.Column("lease_expires_at", sa.Float(), nullable=False),
        sa.Column("create_time", sa.Float(), nullable=False),
        sa.Column("update_time", sa.Float(), nullable=False),
    )
    op.create_index("ix_environments_org_id_id", "environments", ["org_id", "id"])
    op.create_table(
        "bindings",
        sa.Column("environment_id", sa.String(64), primary_key=True),
        sa.Column("session_id", sa.String(128), primary_key=True),
        sa.Column("org_id", sa.String(128), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("output_dir", sa.Text(), nullable=False),
        sa.Column("create_time", sa.Float(), nullable=False),
    )
    op.create_table(
        "registered_files",
        sa.Column("environment_id", sa.String(64), primary_key=True),
        sa.Column("path", sa.String(1024), primary_key=True),
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("file_id", sa.String(64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("create_time", sa.Float(), nullable=False),
    )
    op.create_table(
        "stored_files",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("org_id", sa.String(128), nullable=False),
        sa.Column("filename", sa.Text(), nullable=False),
        sa.Column("purpose", sa.String(64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("create_time", sa.Float(), nullable=False),
        sa.Column("expire_time", sa.Float(), nullable=True),
    )
    op.create_index("ix_stored_files_org_id_id", "stored_files", ["org_id", "id"])
    op.create_table(
        "stored_blobs",
        sa.Column("sha256", sa.String(64), primary_key=True),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("ref_count", sa.Integer(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("stored_blobs")
    op.drop_index("ix_stored_files_org_id_id", table_name="stored_files")
    op.drop_table("stored_files")
    op.drop_table("registered_files")
    op.drop_table("bindings")
    op.drop_index("ix_environments_org_id_id", table_name="environments")
    op.drop_table("environments")
