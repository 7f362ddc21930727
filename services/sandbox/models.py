"""Tables owned by the Sandbox service."""

from __future__ import annotations

from sqlalchemy import Float, Integer, LargeBinary, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = ["Base", "SandboxRow"]


class Base(DeclarativeBase):
    pass


class SandboxRow(Base):
    __tablename__ = "sandboxes"

    sandbox_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    org_id: Mapped[str] = mapped_column(String(64), index=True)
    state: Mapped[str] = mapped_column(String(16), index=True)
    backend: Mapped[str] = mapped_column(String(16))
    isolation: Mapped[str] = mapped_column(String(16))
    labels_json: Mapped[str] = mapped_column(Text, default="{}")
    network_json: Mapped[str] = mapped_column(Text, default="{}")
    env_json: Mapped[str] = mapped_column(Text, default="{}")
    # The environment_variable secrets of its egress proxy, sealed (KeyRing).
    secrets_ciphertext: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True, default=None)
    size: Mapped[int] = mapped_column(Integer, default=0)
    handle_json: Mapped[str] = mapped_column(Text, default="{}")
    error: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[float] = mapped_column(Float)
    last_active_at: Mapped[float] = mapped_column(Float)
