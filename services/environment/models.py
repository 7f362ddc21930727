"""Tables owned by the Environment service.

Timestamps are float Unix seconds. The setup configuration is stored as the
serialized ``EnvironmentConfig`` proto, so the schema does not follow every
contract change.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Boolean, Float, Index, Integer, LargeBinary, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = [
    "Base",
    "EnvironmentRow",
    "BindingRow",
    "RegisteredFileRow",
    "StoredFileRow",
    "StoredBlobRow",
    "McpServerRow",
    "McpServerUseRow",
    "SetupStepRow",
    "VaultRow",
    "VaultCredentialRow",
    "TemplateRow",
    "MCP_ORIGIN_ENVIRONMENT",
    "LIFETIME_PRIVATE",
    "LIFETIME_SHARED",
    "ROLE_OWNER",
    "ROLE_REFERENCE",
]

LIFETIME_PRIVATE = "private"
LIFETIME_SHARED = "shared"

ROLE_OWNER = "owner"
ROLE_REFERENCE = "reference"

MCP_ORIGIN_ENVIRONMENT = "environment"


class Base(DeclarativeBase):
    pass


class EnvironmentRow(Base):
    __tablename__ = "environments"
    __table_args__ = (
        Index("ix_environments_org_id_id", "org_id", "id"),
        # The takeover sweep: initializing rows whose lease expired.
        Index("ix_environments_status_lease", "status", "lease_expires_at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    org_id: Mapped[str] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(16))
    lifetime: Mapped[str] = mapped_column(String(16))
    ever_shared: Mapped[bool] = mapped_column(Boolean, default=False)
    # Set while DeleteEnvironment/DetachSession tear the environment down;
    # blocks attach and init, and hides the row.
    deleting: Mapped[bool] = mapped_column(Boolean, default=False)
    sandbox_id: Mapped[str] = mapped_column(String(64))
    # True once CreateSandbox was attempted, so deletion knows to destroy.
    sandbox_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    # The Sandbox service node the sandbox was placed on, recorded with
    # sandbox_requested; empty is the default node (rows from before nodes,
    # and the single unnamed node of a deployment without BERTH_SANDBOX_ADDRS).
    sandbox_node: Mapped[str] = mapped_column(String(128), default="")
    config: Mapped[bytes] = mapped_column(LargeBinary)
    vault_ids_json: Mapped[str] = mapped_column(Text, default="[]")
    owner_session_id: Mapped[str] = mapped_column(String(128), default="")
    session_count: Mapped[int] = mapped_column(Integer, default=0)
    error_code: Mapped[str] = mapped_column(String(64), default="")
    error_message: Mapped[str] = mapped_column(Text, default="")
    init_version: Mapped[int] = mapped_column(BigInteger, default=0)
    lease_owner: Mapped[str] = mapped_column(String(128), default="")
    lease_expires_at: Mapped[float] = mapped_column(Float, default=0.0)
    create_time: Mapped[float] = mapped_column(Float)
    update_time: Mapped[float] = mapped_column(Float)


class BindingRow(Base):
    __tablename__ = "bindings"

    environment_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    session_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    org_id: Mapped[str] = mapped_column(String(128))
    role: Mapped[str] = mapped_column(String(16))
    output_dir: Mapped[str] = mapped_column(Text)
    create_time: Mapped[float] = mapped_column(Float)


class RegisteredFileRow(Base):
    __tablename__ = "registered_files"

    environment_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    path: Mapped[str] = mapped_column(String(1024), primary_key=True)
    id: Mapped[str] = mapped_column(String(64))
    source: Mapped[str] = mapped_column(String(16))
    file_id: Mapped[str] = mapped_column(String(64), default="")
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    create_time: Mapped[float] = mapped_column(Float)


class StoredFileRow(Base):
    __tablename__ = "stored_files"
    __table_args__ = (Index("ix_stored_files_org_id_id", "org_id", "id"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    org_id: Mapped[str] = mapped_column(String(128))
    filename: Mapped[str] = mapped_column(Text)
    purpose: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    create_time: Mapped[float] = mapped_column(Float)
    expire_time: Mapped[float | None] = mapped_column(Float, nullable=True)


class StoredBlobRow(Base):
    """Reference count of a content-addressed blob; its row lock serializes
    the create that writes a blob with the delete that unlinks it."""

    __tablename__ = "stored_blobs"

    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    ref_count: Mapped[int] = mapped_column(Integer)


class McpServerRow(Base):
    """One server_label of an environment's MCP registry. The row names the
    configuration that started the live broker; the broker's state lives in
    the sandbox."""

    __tablename__ = "mcp_servers"

    environment_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    label: Mapped[str] = mapped_column(String(128), primary_key=True)
    org_id: Mapped[str] = mapped_column(String(128))
    origin: Mapped[str] = mapped_column(String(16))
    # "stdio" or "http".
    transport_type: Mapped[str] = mapped_column(String(16))
    # Empty until the session whose start created the broker records itself.
    owner_session_id: Mapped[str] = mapped_column(String(128), default="")
    create_time: Mapped[float] = mapped_column(Float)


class McpServerUseRow(Base):
    """A session that used a label; deleting the session closes the HTTP
    upstreams of the labels it used."""

    __tablename__ = "mcp_server_uses"

    environment_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    label: Mapped[str] = mapped_column(String(128), primary_key=True)
    session_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    create_time: Mapped[float] = mapped_column(Float)


class SetupStepRow(Base):
    """One setup step recorded as done (the setup journal). A new owner of
    the setup skips these and runs the first step not recorded here."""

    __tablename__ = "setup_steps"

    environment_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    # "sandbox", "file:<n>", "packages:<kind>", "command:<n>", "skills", "plugins".
    step: Mapped[str] = mapped_column(String(64), primary_key=True)
    # The init_version of the owner that recorded it.
    init_version: Mapped[int] = mapped_column(BigInteger)
    done_time: Mapped[float] = mapped_column(Float)


class VaultRow(Base):
    """A vault of one organization; its credentials are VaultCredentialRow."""

    __tablename__ = "vaults"
    __table_args__ = (Index("ix_vaults_org_id", "org_id", "id"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    org_id: Mapped[str] = mapped_column(String(128))
    name: Mapped[str | None] = mapped_column(Text, nullable=True)
    metadata_json: Mapped[str] = mapped_column(Text, default="{}")
    # "active" or "archived" (the SDK's list filter; nothing archives yet).
    status: Mapped[str] = mapped_column(String(16), default="active")
    create_time: Mapped[float] = mapped_column(Float)
    update_time: Mapped[float] = mapped_column(Float)


class VaultCredentialRow(Base):
    """A credential: its public configuration (a serialized CredentialAuth)
    and its secrets as one Fernet token (services/core/key_ring.py)."""

    __tablename__ = "vault_credentials"
    __table_args__ = (Index("ix_vault_credentials_vault_id", "vault_id", "id"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    org_id: Mapped[str] = mapped_column(String(128))
    vault_id: Mapped[str] = mapped_column(String(64))
    name: Mapped[str] = mapped_column(Text)
    metadata_json: Mapped[str] = mapped_column(Text, default="{}")
    auth_type: Mapped[str] = mapped_column(String(32))
    auth: Mapped[bytes] = mapped_column(LargeBinary)
    secret_ciphertext: Mapped[bytes] = mapped_column(LargeBinary)
    # Which key encrypted secret_ciphertext (KeyRing.key_id).
    key_id: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16), default="active")
    create_time: Mapped[float] = mapped_column(Float)
    update_time: Mapped[float] = mapped_column(Float)


class TemplateRow(Base):
    """A reusable environment configuration (``environments.templates``)."""

    __tablename__ = "environment_templates"
    __table_args__ = (Index("ix_environment_templates_org_id_id", "org_id", "id"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    org_id: Mapped[str] = mapped_column(String(128))
    # None when the template has no display name.
    name: Mapped[str | None] = mapped_column(Text, nullable=True)
    # The serialized EnvironmentConfig, as for environments.
    config: Mapped[bytes] = mapped_column(LargeBinary)
    create_time: Mapped[float] = mapped_column(Float)
    update_time: Mapped[float] = mapped_column(Float)
