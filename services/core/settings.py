"""Typed settings read from ``BERTH_*`` environment variables at start-up.

One object per process. The embedded ``berth serve`` and the stand-alone
service entry points build the same object; each service reads the fields it
needs. Addresses are both the listen address of a service and the upstream
address its clients dial.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

__all__ = ["Settings", "DatabasePool", "ServiceName", "ModelRoute", "ModelPrice", "DEFAULT_MODEL_PRICES"]

ServiceName = Literal["gateway", "session", "environment", "sandbox"]


class ModelPrice(BaseModel):
    """USD per million tokens. ``input`` prices uncached input tokens,
    ``cached_input`` the cached ones; ``output`` includes reasoning tokens."""

    input: float = Field(ge=0)
    cached_input: float = Field(ge=0)
    output: float = Field(ge=0)


# Public list prices (USD per 1M tokens) of known models; BERTH_MODEL_PRICES
# adds to and overrides them. A name also prices the models it prefixes.
DEFAULT_MODEL_PRICES: dict[str, ModelPrice] = {
    name: ModelPrice(input=i, cached_input=c, output=o)
    for name, (i, c, o) in {
        "gpt-4o": (2.50, 1.25, 10.00),
        "gpt-4o-mini": (0.15, 0.075, 0.60),
        "gpt-4.1": (2.00, 0.50, 8.00),
        "gpt-4.1-mini": (0.40, 0.10, 1.60),
        "gpt-4.1-nano": (0.10, 0.025, 0.40),
        "gpt-5": (1.25, 0.125, 10.00),
        "gpt-5-mini": (0.25, 0.025, 2.00),
        "gpt-5-nano": (0.05, 0.005, 0.40),
        "o3": (2.00, 0.50, 8.00),
        "o4-mini": (1.10, 0.275, 4.40),
        "scripted": (0.0, 0.0, 0.0),
    }.items()
}


class ModelRoute(BaseModel):
    """Where the models named ``model`` (exactly) or starting with
    ``prefix`` are served: an OpenAI-compatible base URL, its key and API."""

    model: str | None = None
    prefix: str | None = None
    base_url: str
    api_key: str = ""
    api: Literal["chat", "responses"] = "chat"

    @model_validator(mode="after")
    def _one_match(self) -> ModelRoute:
        if (self.model is None) == (self.prefix is None):
            raise ValueError("a model route names exactly one of model or prefix")
        return self


@dataclass(frozen=True)
class DatabasePool:
    """A PostgreSQL engine's connection pool (``Settings.database_pool``)."""

    size: int = 20
    max_overflow: int = 0
    # A connection idle longer than this is pinged at checkout.
    ping_idle_s: float = 5.0


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
    sandbox_addrs: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description=(
            "Sandbox service nodes the Environment service places sandboxes on, as `host:port` or "
            "`name=host:port`, comma-separated or a JSON list; a node without a name is named by its address. "
            "Empty means the one node at `sandbox_addr`. The first node serves environments created before "
            "nodes were recorded."
        ),
    )
    metrics_port: int = Field(default=0, description="Prometheus port of a gRPC service; 0 disables it.")

    # Every internal gRPC call carries this secret (services.core.context);
    # a service started without one refuses to start.
    internal_token: SecretStr = Field(
        default=SecretStr(""),
        description="Shared secret of the deployment's internal gRPC calls (`berth token create` makes one).",
    )
    internal_token_file: Path | None = Field(
        default=None,
        description="File holding the internal token (e.g. a mounted secret), used when `internal_token` is empty.",
    )

    # Vault secrets are encrypted at rest with Fernet keys (services/core/key_ring.py).
    vault_keys: SecretStr = Field(
        default=SecretStr(""),
        description=(
            "Fernet keys that encrypt vault secrets, comma-separated, newest first: the first encrypts, every one "
            "decrypts, and the Environment service re-encrypts older rows with the first at start (rotation)."
        ),
    )
    vault_keys_file: Path | None = Field(
        default=None,
        description=(
            "File holding the vault keys, one a line, newest first; used when `vault_keys` is empty. With neither, "
            "the Environment service creates `vault.keys` under `data_dir` (one replica only)."
        ),
    )
    oauth_allow_private_endpoints: bool = Field(
        default=False,
        description=(
            "Let OAuth token endpoints of vault credentials be loopback, private or link-local addresses. The "
            "Environment service calls them from the control plane, so they must be global by default (SSRF)."
        ),
    )
    oauth_refresh_timeout_s: float = Field(
        default=10.0, gt=0, description="Bound on one OAuth token refresh request (connect, send and read)."
    )
    outbound_ca_bundle: str = Field(
        default="",
        description=(
            "CA bundle that TLS from the services to user-supplied endpoints (OAuth token endpoints) trusts; "
            "default the host's /etc/ssl/certs/ca-certificates.crt, else the system default."
        ),
    )

    sandbox_secret_keys: SecretStr = Field(
        default=SecretStr(""),
        description=(
            "Fernet keys that seal the environment_variable secrets a Sandbox service keeps for its sandboxes' egress "
            "proxies, comma-separated, newest first. Empty: `sandbox-secrets.keys` under `data_dir`, created on first start."
        ),
    )

    gateway_database_url: str = ""
    session_database_url: str = ""
    environment_database_url: str = ""
    sandbox_database_url: str = ""
    database_pool_size: int = Field(
        default=DatabasePool.size,
        gt=0,
        description=(
            "On PostgreSQL, the connections each service keeps open once it has needed them; a transaction that "
            "finds them all busy waits for one. The four services' pools (times their replicas) must fit the "
            "server's `max_connections` (100 by default)."
        ),
    )
    database_max_overflow: int = Field(
        default=DatabasePool.max_overflow,
        ge=0,
        description=(
            "On PostgreSQL, connections a busy service opens beyond `database_pool_size`, each closed when it is "
            "returned: a load hovering above the pool opens and closes one per transaction, which costs more than "
            "waiting for a pooled one."
        ),
    )
    database_ping_idle_s: float = Field(
        default=DatabasePool.ping_idle_s,
        ge=0,
        description=(
            "On PostgreSQL, a pooled connection idle this long is pinged before it is handed out (a dead one, after a "
            "database restart, is replaced); one in steady use is not. 0 pings every checkout."
        ),
    )

    notify_listen: bool = Field(
        default=True,
        description=(
            "On PostgreSQL, hear other replicas' commits through LISTEN/NOTIFY. Turn off behind a pooler that does "
            "not keep sessions (PgBouncer in transaction mode): replicas then find each other's commits by polling."
        ),
    )
    session_sole_writer: bool = Field(
        default=False,
        description=(
            "The Session service is the only process writing its SQLite database (`berth serve` sets this): its "
            "streams and turns hear every commit in process and re-read the database only every "
            "`notify_safety_poll_s` instead of every 0.2 s. Never set it for replicas sharing one SQLite file."
        ),
    )
    notify_safety_poll_s: float = Field(
        default=5.0,
        gt=0,
        description=(
            "On PostgreSQL, commits are announced to the other replicas with LISTEN/NOTIFY; a waiting stream or "
            "turn re-reads the database without a notification only this often (a safety net)."
        ),
    )
    rpc_timeout_s: float = Field(default=30.0, gt=0, description="Deadline of unary gRPC calls.")
    gateway_upstream_wait_s: float = Field(
        default=10.0,
        ge=0,
        description=(
            "How long a gateway request waits for a connection to a Session or Environment service that is down "
            "or restarting before it fails with 503 `service_unavailable` (a request that fails so was never "
            "sent, so its Idempotency-Key is released). 0 fails at once, as a plain gRPC call does."
        ),
    )
    grace_s: float = Field(default=5.0, ge=0, description="Graceful shutdown period.")
    serve_processes: bool = Field(
        default=True,
        description=(
            "`berth serve` runs each service in a process of its own under one supervisor, so they use every core; "
            "false runs all four in one process and one event loop."
        ),
    )
    serve_start_timeout_s: float = Field(
        default=120.0, gt=0, description="Bound on each of `berth serve`'s service processes becoming ready."
    )
    serve_lifeline_fd: int | None = Field(
        default=None,
        description="Set by `berth serve` for its children: a pipe that ends when the supervisor is gone, and the child stops.",
    )
    max_body_bytes: int = Field(default=32 * 1024 * 1024, gt=0, description="Largest accepted HTTP body.")
    sse_keepalive_s: float = Field(default=15.0, gt=0, description="Idle interval between SSE keep-alive comments.")

    sandbox_backend: Literal["local", "docker"] = "local"
    sandbox_isolation: Literal["bwrap", "none"] = "bwrap"
    sandbox_idle_pause_s: float = Field(default=300.0, ge=0)
    sandbox_dormant_after_s: float = Field(
        default=60.0,
        ge=0,
        description=(
            "Idle seconds after which a local sandbox's daemon, if nothing runs in the sandbox, shrinks to a bare "
            "interpreter holding its socket (about 2.5 MiB instead of 13); its next request waits for it to "
            "start again. 0 keeps it whole."
        ),
    )
    sandbox_pool_size: int = Field(
        default=0,
        ge=0,
        description=(
            "Started local sandboxes kept ready per (container size, network policy) in use, so creating a "
            "sandbox skips bubblewrap, the workspace filesystem, the cgroups and the network; 0 disables the pool. "
            "A key is kept warm from its first sandbox on."
        ),
    )
    docker_image: str = "berth-sandbox:latest"
    docker_start_timeout_s: float = Field(default=30.0, gt=0, description="Bound on a sandbox container's daemon becoming ready.")
    docker_pool_size: int = Field(
        default=2,
        ge=0,
        description=(
            "Started containers the docker backend keeps ready per container size in use, so creating a sandbox "
            "skips `docker create`; 0 disables the pools."
        ),
    )
    docker_pool_sizes: Annotated[list[Literal["small", "medium", "large"]], NoDecode] = Field(
        default=["medium"],
        description=(
            "Container sizes whose warm pool is filled from start, comma-separated (every network policy "
            "shares a size's pool). A size not listed is kept warm from its first sandbox on; empty "
            "pre-fills nothing."
        ),
    )
    sandbox_extra_ro_mounts: dict[str, str] = Field(
        default_factory=dict,
        description="Host paths bind-mounted read-only into local sandboxes, as JSON {host_path: sandbox_path}.",
    )
    sandbox_ca_bundle: str = Field(default="", description="CA bundle made available to sandboxes; default the host's.")
    sandbox_allow_cidrs: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description=(
            "Destinations (CIDRs, comma-separated) that sandboxes with network enabled may reach although they are "
            "private, loopback, link-local or the host's own addresses, which are unreachable otherwise."
        ),
    )
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

    dependency_retry_s: float = Field(
        default=60.0,
        ge=0,
        description=(
            "How long a turn keeps retrying, with backoff, an Environment or Sandbox service that is UNAVAILABLE "
            "(down or restarting) before the turn fails; the turn's events say it is waiting meanwhile."
        ),
    )
    turn_lease_s: float = Field(
        default=6.0,
        gt=0,
        description=(
            "Lease of a running turn, renewed every third of it; when its Session service process dies, "
            "another (or the restarted one) resumes the turn once the lease expired."
        ),
    )
    automation_poll_s: float = Field(
        default=1.0,
        gt=0,
        description=(
            "Longest sleep of a Session service's automation scheduler between looks at the schedule; it wakes "
            "at the earliest due time it knows, so this bounds the lag only for changes made on another replica."
        ),
    )
    automation_delivery_lease_s: float = Field(
        default=30.0,
        gt=0,
        description=(
            "Lease of an automation invocation being delivered; if its replica dies, another delivers it again "
            "once the lease expired."
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
    environment_reconcile_max_fraction: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description=(
            "A reconcile pass that would destroy more than this fraction of the labelled sandboxes past their "
            "grace (and more than 10) destroys none and logs an error: a sign of a wrong or restored database. "
            "1 lifts the limit, e.g. to clean up deliberately."
        ),
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
    model_routes: list[ModelRoute] = Field(
        default_factory=list,
        description=(
            "JSON list of {model|prefix, base_url, api_key, api}: models served elsewhere than model_base_url. "
            "An exact model match wins, then the longest prefix."
        ),
    )
    model_max_retries: int = Field(default=4, ge=0, description="Retries of a model call after a 429, 5xx or connection error.")
    model_retry_base_delay_s: float = Field(default=0.5, gt=0, description="First backoff delay; doubled per retry, with jitter.")
    model_retry_max_delay_s: float = Field(
        default=30.0, gt=0, description="Longest backoff delay; a longer Retry-After ends the retries."
    )
    model_timeout_s: float = Field(default=600.0, gt=0, description="Bound on one model request.")
    tool_call_concurrency: int = Field(default=16, ge=1, description="Tool calls of one model response run at most this many at a time.")
    model_prices: dict[str, ModelPrice] = Field(
        default_factory=dict,
        description=(
            "JSON {model: {input, cached_input, output}} in USD per million tokens, over the built-in table "
            "(DEFAULT_MODEL_PRICES); prices a session's spend_control budget. A name also prices the models it "
            "prefixes (the longest wins)."
        ),
    )

    webhook_secret_key: SecretStr = Field(
        default=SecretStr(""),
        description=(
            "Fernet keys (urlsafe base64 of 32 bytes; comma-separated, newest first: the first encrypts, all "
            "decrypt) that encrypt webhook signing secrets at rest. Every Session replica needs the same ones; "
            "unset, a key file under data_dir is created on first use."
        ),
    )
    webhook_secret_key_file: str = Field(default="", description="File holding the webhook secret key instead.")
    webhook_allow_destinations: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description=(
            "CIDRs or host names (comma-separated) webhooks may be delivered to although they are private, "
            "loopback, link-local or reserved, which are refused otherwise; listed destinations may also use http."
        ),
    )
    webhook_timeout_s: float = Field(default=10.0, gt=0, description="Bound on one webhook delivery attempt.")
    webhook_retry_base_s: float = Field(
        default=5.0, gt=0, description="First webhook retry delay; doubled per failed attempt, with full jitter."
    )
    webhook_retry_max_s: float = Field(default=3600.0, gt=0, description="Longest webhook retry delay.")
    webhook_disable_after: int = Field(
        default=50, ge=1, description="An endpoint is disabled after this many consecutive failed delivery attempts."
    )
    webhook_concurrency: int = Field(default=16, ge=1, description="Deliveries one Session replica attempts at a time.")
    webhook_claim_s: float = Field(
        default=60.0, gt=0, description="A claimed delivery whose worker died is attempted again after this long."
    )
    model_context_windows: dict[str, int] = Field(
        default_factory=dict,
        description=(
            "JSON {model name or prefix: tokens}: context windows over the built-in defaults for known model "
            "families (services/session/harness/context.py); the longest matching prefix wins."
        ),
    )
    model_context_window: int = Field(
        default=128_000, ge=1024, description="Context window, in tokens, of a model neither setting nor default knows."
    )
    compaction_threshold: float = Field(
        default=0.8,
        gt=0.1,
        lt=1.0,
        description="Fraction of the context window a request may fill before the history is compacted first.",
    )
    trace_otlp_endpoint: str = Field(
        default="", description="OTLP/HTTP JSON traces endpoint (e.g. http://collector:4318/v1/traces); unset exports nothing."
    )

    dev_org: str = "dev"

    @field_validator("docker_pool_sizes", "sandbox_allow_cidrs", "webhook_allow_destinations", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        """``BERTH_DOCKER_POOL_SIZES=small,medium`` rather than JSON."""
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("sandbox_allow_cidrs")
    @classmethod
    def _cidrs_valid(cls, value: list[str]) -> list[str]:
        return [str(ipaddress.ip_network(entry, strict=False)) for entry in value]

    def database_pool(self) -> DatabasePool:
        return DatabasePool(self.database_pool_size, self.database_max_overflow, self.database_ping_idle_s)

    def database_url(self, service: ServiceName) -> str:
        """The service's own database; SQLite under data_dir unless configured."""
        configured: str = getattr(self, f"{service}_database_url")
        if configured:
            return normalize_database_url(configured)
        path = (self.data_dir / f"{service}.db").resolve()
        return f"sqlite+berth:///{path}"

    @field_validator("sandbox_addrs", mode="before")
    @classmethod
    def _sandbox_addr_list(cls, value: object) -> object:
        """``BERTH_SANDBOX_ADDRS`` as a JSON list or comma-separated."""
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [part.strip() for part in text.split(",") if part.strip()]
        return value

    @field_validator("sandbox_addrs")
    @classmethod
    def _sandbox_addrs_valid(cls, value: list[str]) -> list[str]:
        parse_sandbox_nodes(value)  # fails start-up on a bad entry or a duplicate name
        return value

    def sandbox_nodes(self) -> dict[str, str]:
        """Node name -> address, in configured order (the first is the
        default node). Without ``sandbox_addrs`` it is one node with the empty
        name at ``sandbox_addr``: environments record that empty name, so
        moving that one Sandbox service to another address keeps them."""
        if not self.sandbox_addrs:
            return {"": self.sandbox_addr}
        return parse_sandbox_nodes(self.sandbox_addrs)


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

# Node names are stored with each environment (String(128)).
_MAX_NODE_NAME = 128


def parse_sandbox_nodes(entries: Sequence[str]) -> dict[str, str]:
    """``host:port`` or ``name=host:port`` entries as node name -> address,
    in order. A name is 1-128 printable characters without spaces, ``=``
    or ``,``; names are unique."""
    nodes: dict[str, str] = {}
    for entry in entries:
        name, sep, address = entry.strip().partition("=")
        if not sep:
            name, address = entry.strip(), entry.strip()
        name, address = name.strip(), address.strip()
        if not address or any(c.isspace() for c in address):
            raise ValueError(f"sandbox node {entry!r} needs an address host:port")
        if not 0 < len(name) <= _MAX_NODE_NAME or not name.isprintable() or any(c.isspace() or c in "=," for c in name):
            raise ValueError(f"sandbox node {entry!r} has an invalid name")
        if name in nodes:
            raise ValueError(f"sandbox node name {name!r} is listed twice")
        nodes[name] = address
    return nodes


__all__ += ["parse_sandbox_nodes"]
