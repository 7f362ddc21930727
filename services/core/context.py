"""Request context that travels between services in gRPC metadata."""

from __future__ import annotations

from contextvars import ContextVar

__all__ = ["ORG_METADATA_KEY", "REQUEST_ID_METADATA_KEY", "current_org", "org_metadata", "org_id_var", "request_id_var"]

ORG_METADATA_KEY = "x-berth-org"
REQUEST_ID_METADATA_KEY = "x-request-id"

org_id_var: ContextVar[str] = ContextVar("berth_org_id", default="")
request_id_var: ContextVar[str] = ContextVar("berth_request_id", default="")


def current_org() -> str:
    """The organization of the RPC being served. The interceptor has already
    rejected calls without one, so an empty value here is a programming error."""
    org = org_id_var.get()
    if not org:
        raise RuntimeError("no organization in context")
    return org


def org_metadata(org_id: str, request_id: str = "") -> tuple[tuple[str, str], ...]:
    md: list[tuple[str, str]] = [(ORG_METADATA_KEY, org_id)]
    if request_id:
        md.append((REQUEST_ID_METADATA_KEY, request_id))
    return tuple(md)
