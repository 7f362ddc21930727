"""Shared Alembic environment: runs a service's migrations on the connection
handed over in ``config.attributes`` (see services.core.db.migrate)."""

from __future__ import annotations

from alembic import context

config = context.config
connection = config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=None,
    version_table=config.attributes["version_table"],
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
