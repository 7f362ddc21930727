"""Session service: automations and their invocations.

Revision ID: session_0004
Revises: session_0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "session_0004"
down_revision = "session_0003"
branch_labels = None
depends_on = None


def _pk() -> sa.Column[int]:
    return sa.Column("pk", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True)


def upgrade() -> None:
    op.create_table(
        "automations",
        _pk(),
        sa.Column("id", sa.String(64), nullable=False, unique=True),
        sa.Column("org_id", sa.String(128), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("expression", sa.Text(), nullable=False),
        sa.Column("timezone", sa.String(64), nullable=False),
        sa.Column("run_at", sa.Float(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("pause_reason", sa.String(32), nullable=False),
        sa.Column("creator_session_id", sa.String(64), nullable=False),
        sa.Column("creator_tool_call_id", sa.String(128), nullable=False),
        sa.Column("target_session_id", sa.String(64), nullable=False),
        sa.Column("target_pb", sa.LargeBinary(), nullable=False),
        sa.Column("metadata_json", sa.Text(), nullable=False),
        sa.Column("next_run_at", sa.Float(), nullable=True),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
    )
    op.create_index("ix_automations_org_id", "automations", ["org_id"])
    op.create_index("ix_automations_target_session_id", "automations", ["target_session_id"])
    op.create_index("ix_automations_next_run_at", "automations", ["next_run_at"])
    op.create_table(
        "automation_invocations",
        _pk(),
        sa.Column("id", sa.String(64), nullable=False, unique=True),
        sa.Column("org_id", sa.String(128), nullable=False),
        sa.Column("automation_id", sa.String(64), nullable=False),
        sa.Column("scheduled_at", sa.Float(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("session_id", sa.String(64), nullable=False),
        sa.Column("skip_reason", sa.String(32), nullable=False),
        sa.Column("error_code", sa.String(64), nullable=False),
        sa.Column("error_message", sa.Text(), nullable=False),
        sa.Column("snapshot_pb", sa.LargeBinary(), nullable=True),
        sa.Column("lease_until", sa.Float(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.UniqueConstraint("automation_id", "scheduled_at", name="uq_invocation_occurrence"),
    )
    op.create_index("ix_automation_invocations_automation_id", "automation_invocations", ["automation_id"])
    op.create_index("ix_automation_invocations_status", "automation_invocations", ["status"])


def downgrade() -> None:
    op.drop_table("automation_invocations")
    op.drop_table("automations")
