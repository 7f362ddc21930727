"""An index on sandboxes.state: the live count that places new sandboxes and
the state gauge read by state, and destroyed rows are kept for good.

Revision ID: sandbox_0003
Revises: sandbox_0002
"""

from __future__ import annotations

from alembic import op

revision = "sandbox_0003"
down_revision = "sandbox_0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_sandboxes_state", "sandboxes", ["state"])


def downgrade() -> None:
    op.drop_index("ix_sandboxes_state", table_name="sandboxes")
