"""Authentication and authorization of ``/v1`` requests.

Order of checks: the API key (401 ``missing_api_key`` / ``invalid_api_key``),
then the ``OpenAI-Beta: agents=v1`` header on ``/v1/agents/**`` (400
``missing_beta_header``; the SDK sends it on every agents route but not on
``/v1/files``), then the scope: reads (GET) need ``tasks:read``, everything
else needs ``tasks:write``. Write does not imply read.

The key's organization becomes the request's org: it is put in the context
var the gRPC client interceptor forwards as ``x-berth-org``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import structlog
from fastapi import Depends, Request

from gateway.errors import ApiError
from gateway.keys import SCOPE_READ, SCOPE_WRITE, authenticate_key
from gateway.state import StateDep
from services.core.context import org_id_var

__all__ = ["Principal", "authorize", "PrincipalDep", "required_scope", "requires_beta_header", "BETA_HEADER_VALUE"]

BETA_HEADER_VALUE = "agents=v1"
_BETA_PATH_PREFIX = "/v1/agents"
_READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclass(frozen=True)
class Principal:
    key_id: str
    org_id: str
    scopes: frozenset[str]


def required_scope(method: str) -> str:
    return SCOPE_READ if method.upper() in _READ_METHODS else SCOPE_WRITE


def requires_beta_header(path: str) -> bool:
    """The SDK sends ``OpenAI-Beta`` on the agents routes only."""
    return path.startswith(_BETA_PATH_PREFIX)


def _bearer_token(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if not header or scheme.lower() != "bearer" or not token.strip():
        raise ApiError(
            401,
            "missing_api_key",
            "You didn't provide an API key. Pass it as 'Authorization: Bearer <key>'.",
            type="authentication_error",
        )
    return token.strip()


def _has_beta_header(request: Request) -> bool:
    values = ",".join(request.headers.getlist("openai-beta"))
    return any(part.strip() == BETA_HEADER_VALUE for part in values.split(","))


async def authorize(request: Request, state: StateDep) -> Principal:
    """The dependency every ``/v1`` route runs first."""
    token = _bearer_token(request)
    key = await authenticate_key(state.db, token)
    if key is None:
        raise ApiError(401, "invalid_api_key", "Incorrect or revoked API key provided.", type="authentication_error")
    if requires_beta_header(request.url.path) and not _has_beta_header(request):
        raise ApiError(
            400, "missing_beta_header", f"This endpoint requires the 'OpenAI-Beta: {BETA_HEADER_VALUE}' header."
        )
    scope = required_scope(request.method)
    if scope not in key.scopes:
        raise ApiError(
            403, "insufficient_scopes", f"The API key lacks the required scope: {scope}.", type="permission_error"
        )
    # Async dependencies run in the endpoint's task, so the endpoint and the
    # streams it starts see these values.
    org_id_var.set(key.org_id)
    structlog.contextvars.bind_contextvars(org_id=key.org_id, key_id=key.key_id)
    return Principal(key_id=key.key_id, org_id=key.org_id, scopes=key.scopes)


PrincipalDep = Annotated[Principal, Depends(authorize)]
