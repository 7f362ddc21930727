"""Helpers shared by the route modules."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse

from berth.session.v1 import session_service_pb2
from gateway.auth import authorize
from gateway.errors import ApiError
from gateway.validation import canonical_json, check_text, parse_json_body

__all__ = ["v1_router", "JsonBody", "read_json", "require_id", "Page", "PageDep", "json_response", "body_hash", "stream_content"]

_ID_BODY = r"[0-9A-Za-z][0-9A-Za-z_-]{0,127}"


def v1_router() -> APIRouter:
    """A router for authenticated ``/v1`` routes. Each module declares the full
    path (prefix included) so the route template metrics see is the public one."""
    return APIRouter(prefix="/v1", dependencies=[Depends(authorize), Depends(_storable_query)])


async def _storable_query(request: Request) -> None:
    """No query parameter carries what a store cannot hold (a NUL in a
    cursor reached PostgreSQL as a 500). Async: FastAPI runs a sync
    dependency on its thread pool, a hop per request."""
    for key, value in request.query_params.multi_items():
        check_text(key, key)
        check_text(value, key)


@dataclass(frozen=True)
class JsonBody:
    data: Any
    hash: str


def body_hash(value: Any) -> str:
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()


async def read_json(request: Request) -> JsonBody:
    """The parsed body and the hash idempotency compares (of its canonical
    form, so key order and whitespace do not matter)."""
    data = parse_json_body(await request.body())
    return JsonBody(data=data, hash=body_hash(data))


def require_id(value: str, prefix: str) -> str:
    """A malformed ID can name nothing: 404 without asking a service."""
    sep = "-" if prefix == "file" else "_"
    if not re.fullmatch(re.escape(prefix + sep) + _ID_BODY, value):
        raise ApiError(404, "not_found", f"No such object: '{value}'.")
    return value


@dataclass(frozen=True)
class Page:
    after: str
    limit: int
    order: str

    def to_proto(self) -> session_service_pb2.PageRequest:
        return session_service_pb2.PageRequest(limit=self.limit, after=self.after, order=self.order)


async def _page(
    after: Annotated[str | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Annotated[Literal["asc", "desc"], Query()] = "desc",
) -> Page:
    return Page(after=after or "", limit=limit, order=order)


PageDep = Annotated[Page, Depends(_page)]


def json_response(content: Any, status_code: int = 200) -> JSONResponse:
    return JSONResponse(content, status_code=status_code)


def stream_content(call: Any, media_type: str) -> StreamingResponse:
    """Streams a gRPC response stream of ``data`` chunks as the HTTP body;
    a client that disconnects cancels the call."""

    async def chunks() -> AsyncIterator[bytes]:
        try:
            async for chunk in call:
                yield chunk.data
        finally:
            call.cancel()

    return StreamingResponse(chunks(), media_type=media_type)
