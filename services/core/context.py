"""Request context and peer credentials that travel between services in gRPC
metadata.

Every internal call carries the deployment's internal token and the name of
the calling peer; the server interceptor checks both before it reads the
organization. The peer name is a claim made by a holder of the token: it
routes each RPC to the callers that need it (``allowed_callers``), it does not
separate one token holder from another.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Literal, get_args

from services.core.settings import Settings

__all__ = [
    "ORG_METADATA_KEY",
    "REQUEST_ID_METADATA_KEY",
    "TOKEN_METADATA_KEY",
    "PEER_METADATA_KEY",
    "Peer",
    "PEERS",
    "PeerCredentials",
    "InternalTokenMissing",
    "internal_token",
    "current_org",
    "org_metadata",
    "org_id_var",
    "request_id_var",
]

ORG_METADATA_KEY = "x-berth-org"
REQUEST_ID_METADATA_KEY = "x-request-id"
TOKEN_METADATA_KEY = "x-berth-token"
PEER_METADATA_KEY = "x-berth-peer"

Peer = Literal["gateway", "session", "environment", "sandbox", "cli"]
PEERS: frozenset[str] = frozenset(get_args(Peer))

# Shorter secrets are refused: the token is the only thing between a process
# that reaches a service's port and every organization's data.
_MIN_TOKEN_CHARS = 16

org_id_var: ContextVar[str] = ContextVar("berth_org_id", default="")
request_id_var: ContextVar[str] = ContextVar("berth_request_id", default="")


class InternalTokenMissing(RuntimeError):
    """No usable internal token is configured; the process must not start."""


def internal_token(settings: Settings) -> str:
    """The deployment's internal token: ``BERTH_INTERNAL_TOKEN``, or else the
    contents of ``BERTH_INTERNAL_TOKEN_FILE``. Raises ``InternalTokenMissing``
    when neither gives one, so a service without it fails closed at start-up."""
    token = settings.internal_token.get_secret_value().strip()
    source = "BERTH_INTERNAL_TOKEN"
    if not token and settings.internal_token_file is not None:
        source = f"BERTH_INTERNAL_TOKEN_FILE ({settings.internal_token_file})"
        try:
            token = settings.internal_token_file.read_text().strip()
        except OSError as exc:
            raise InternalTokenMissing(f"cannot read {source}: {exc.strerror}") from exc
    if not token:
        raise InternalTokenMissing(
            "no internal token: set BERTH_INTERNAL_TOKEN or BERTH_INTERNAL_TOKEN_FILE to the deployment's "
            "shared secret (make one with `berth token create`)"
        )
    if len(token) < _MIN_TOKEN_CHARS:
        raise InternalTokenMissing(f"the internal token from {source} is shorter than {_MIN_TOKEN_CHARS} characters")
    return token


@dataclass(frozen=True)
class PeerCredentials:
    """What a client attaches to every call: who it is and the shared secret."""

    peer: Peer
    token: str = field(repr=False)

    @classmethod
    def from_settings(cls, settings: Settings, peer: Peer) -> PeerCredentials:
        return cls(peer, internal_token(settings))

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((TOKEN_METADATA_KEY, self.token), (PEER_METADATA_KEY, self.peer))


def current_org() -> str:
    """The organization of the RPC being served. The interceptor has already
    rejected calls without one, so an empty value here is a programming error.

    Servicers alone call this, once per RPC, and hand the organization to
    the domain as an argument: service code takes ``org_id`` explicitly (a
    required parameter cannot be forgotten) and repositories filter by it in
    SQL. Background work that serves no request passes the organization of
    the rows it handles, and sets ``org_id_var`` to it only so that its
    outbound calls carry it (the client interceptor reads the variable)."""
    org = org_id_var.get()
    if not org:
        raise RuntimeError("no organization in context")
    return org


def org_metadata(org_id: str, request_id: str = "") -> tuple[tuple[str, str], ...]:
    md: list[tuple[str, str]] = [(ORG_METADATA_KEY, org_id)]
    if request_id:
        md.append((REQUEST_ID_METADATA_KEY, request_id))
    return tuple(md)
