"""Typed settings read from ``BERTH_*`` environment variables at start-up.

One object per process. The embedded ``berth serve`` and the stand-alone
service entry points build the same object; each service reads the fields it
needs. Addresses are both the listen address of a service and the upstream
address its clients dial.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings", "ServiceName"]

ServiceName = Literal["gateway", "session", "environment", "sandbox"]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BERTH_", extra="ignore")

    data_dir: Path = Field(default=Path(".berth"), description="Root of SQLite files, blobs and sandboxes.")
    log_level: str = "INFO"
    log_json: bool | None = Field(default=None, description="Force JSON logs; default is JSON when not a TTY.")

    gateway_host: str = "127.0.0.1"
    gateway_port: int = 8080
    session_addr: str = "127.0.0.1:50051"
    environment_addr: str = "127.0.0.1:50052"
    sandbox_addr: str = "127.0.0.1:50053"
    metrics_port: int = Field(default=0, description="Prometheus port of a gRPC service; 0 disables it.")

    gateway_database_url: str = ""
    session_database_url: str = ""
    environment_database_url: str = ""
    sandbox_database_url: str = ""

    rpc_timeout_s: float = Field(default=30.0, gt=0, description="Deadline of unary gRPC calls.")
    grace_s: float = Field(default=5.0, ge=0, description="Graceful shutdown period.")
    max_body_bytes: int = Field(default=32 * 1024 * 1024, gt=0, description="Largest accepted HTTP body.")
    sse_keepalive_s: float = Field(default=15.0, gt=0, description="Idle interval between SSE keep-alive comments.")

    sandbox_backend: Literal["local", "docker"] = "local"
    sandbox_isolation: Literal["bwrap", "none"] = "bwrap"
    sandbox_idle_pause_s: float = Field(default=300.0, ge=0)
    docker_image: str = "berth-sandbox:latest"
    docker_network: str = Field(
        default="",
        description=(
            "Docker network of sandboxes whose network is enabled: empty picks the engine's default "
            "`bridge`, or else a user-defined bridge `berth-sandbox` created on demand; `host` shares "
            "the host's network stack (and its loopback services); any other value names a network (created as a bridge if missing)."
        ),
    )
    docker_start_timeout_s: float = Field(default=30.0, gt=0, description="Bound on a sandbox container's daemon becoming ready.")
    docker_pool_size: int = Field(
        default=2,
        ge=0,
        description=(
            "Started containers the docker backend keeps ready for sandboxes without network, so creating one "
            "skips `docker create`; 0 disables the pool."
        ),
    )
    sandbox_extra_ro_mounts: dict[str, str] = Field(
        default_factory=dict,
        description="Host paths bind-mounted read-only into local sandboxes, as JSON {host_path: sandbox_path}.",
    )
    sandbox_ca_bundle: str = Field(default="", description="CA bundle made available to sandboxes; default the host's.")
    sandbox_http_proxy: str = ""
    sandbox_https_proxy: str = ""
    sandbox_no_proxy: str = ""
    sandbox_egress_allow_private: bool = Field(
        default=False,
        description=(
            "Let restricted sandboxes' egress proxy reach loopback, private and link-local addresses "
            "(refused by default against SSRF, e.g. cloud metadata); for tests and trusted networks."
        ),
    )

    init_lease_s: float = Field(default=60.0, gt=0, description="Lease of an init-once operation; renewed while it runs.")
    environment_reconcile_interval_s: float = Field(
        default=300.0,
        ge=0,
        description=(
            "Period of the Environment service's pass that destroys sandboxes whose environment no longer exists; "
            "it also runs on start. 0 disables it (e.g. when several deployments share one Sandbox service)."
        ),
    )
    environment_reconcile_grace_s: float = Field(
        default=600.0,
        ge=0,
        description="Sandboxes younger than this (by the Sandbox service's clock) are never reaped.",
    )
    setup_timeout_s: float = Field(default=900.0, gt=0)
    mcp_call_timeout_s: float = Field(
        default=600.0, gt=0, description="Bound on one MCP request (a tool call, a listing) from the harness to a server."
    )
    mcp_connect_timeout_s: float = Field(
        default=60.0, gt=0, description="Bound on connecting to and initializing one MCP server at the start of a turn."
    )

    model_base_url: str = ""
    model_api_key: str = ""
    model_provider: str = Field(default="", description="Force a provider; default by model name.")
    model_api: Literal["chat", "responses"] = "chat"

    dev_org: str = "dev"

    def database_url(self, service: ServiceName) -> str:
        """The service's own database; SQLite under data_dir unless configured."""
        configured: str = getattr(self, f"{service}_database_url")
        if configured:
            return normalize_database_url(configured)
        path = (self.data_dir / f"{service}.db").resolve()
        return f"sqlite+berth:///{path}"


def normalize_database_url(url: str) -> str:
    """Accepts plain ``postgresql://`` and ``sqlite:///`` URLs and picks the
    async drivers Berth uses: asyncpg, and for SQLite Berth's own driver that
    runs statements on the event loop (services/core/sqlite_inline.py). An
    explicit ``sqlite+aiosqlite://`` URL keeps aiosqlite."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://"):]
    if url.startswith("postgresql://"):
        return "postgresql+asyncpg://" + url[len("postgresql://"):]
    if url.startswith("sqlite://"):
        return "sqlite+berth://" + url[len("sqlite://"):]
    return url


__all__ += ["normalize_database_url"]
