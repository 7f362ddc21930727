"""``Idempotency-Key`` for creating POSTs, in one dependency.

A key is scoped to (organization, key, method, path). The first request
records a placeholder with the SHA-256 of its canonical body, runs, and
stores its status and response. A later request with the same key:

* same body, finished -> the stored response, same status (the service is
  not called again);
* same body, still running -> 409 ``idempotency_request_in_progress``
  (retryable);
* different body -> 409 ``idempotency_key_reused``.

A failed attempt that may have written something stays bound to its
outcome: a 5xx other than 503 (an internal error, a timeout, a failure after
the service answered) is stored like a success, so an SDK retry replays it
instead of creating a duplicate (replayed errors say ``x-should-retry:
false``). A 4xx (the request was refused whole) or a 503 (the service was
not reached or did nothing) releases the key so a retry runs again, as does
a request cancelled by its client. Records expire after a day; a
placeholder whose request died is taken over after a few deadlines.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated

import grpc
from fastapi import Depends, Request
from fastapi.responses import Response
from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError

from gateway.auth import PrincipalDep
from gateway.errors import ApiError, error_response, internal_error, map_rpc_error
from gateway.models import IdempotencyRow
from gateway.state import StateDep
from services.core.db import Database

__all__ = ["IDEMPOTENCY_HEADER", "StoredResponse", "IdempotentRequest", "Idempotency", "IdempotencyDep"]

IDEMPOTENCY_HEADER = "idempotency-key"
_MAX_KEY_LEN = 255
_RETENTION_S = 24 * 3600.0


@dataclass(frozen=True)
class StoredResponse:
    status: int
    media_type: str
    body: str

    def to_response(self) -> Response:
        headers = {"idempotent-replayed": "true"}
        if self.status >= 400:
            # The stored outcome is final for this key: retrying replays it.
            headers["x-should-retry"] = "false"
        return Response(content=self.body, status_code=self.status, media_type=self.media_type, headers=headers)


class IdempotentRequest:
    """One request's hold on a key; a no-op when the request has no key."""

    def __init__(self, db: Database | None, row_id: int | None, replay: StoredResponse | None) -> None:
        self._db = db
        self._row_id = row_id
        self.replay = replay
        self._stored = False

    async def store(self, status: int, body: str, media_type: str = "application/json") -> None:
        if self._db is None or self._row_id is None:
            return
        async with self._db.transaction() as s:
            row = await s.get(IdempotencyRow, self._row_id)
            if row is not None:
                row.status_code = status
                row.media_type = media_type
                row.response_body = body
                row.completed_at = time.time()
        self._stored = True

    async def _release(self) -> None:
        if self._db is None or self._row_id is None or self._stored:
            return
        async with self._db.transaction() as s:
            await s.execute(delete(IdempotencyRow).where(IdempotencyRow.id == self._row_id))


class Idempotency:
    """Handed to routes by the dependency; ``begin`` claims the key."""

    def __init__(self, db: Database, org_id: str, key: str | None, method: str, path: str, stale_after_s: float) -> None:
        self._db = db
        self._org_id = org_id
        self.key = key
        self._method = method
        self._path = path
        self._stale_after_s = stale_after_s

    @asynccontextmanager
    async def begin(self, request_hash: str) -> AsyncIterator[IdempotentRequest]:
        if self.key is None:
            yield IdempotentRequest(None, None, None)
            return
        held = await self._claim(request_hash)
        try:
            yield held
        except Exception as exc:
            error = exc if isinstance(exc, ApiError) else map_rpc_error(exc) if isinstance(exc, grpc.RpcError) else internal_error()
            if error.status < 500 or error.status == 503:
                await held._release()
            else:
                await held.store(error.status, bytes(error_response(error).body).decode())
            if error is exc or not isinstance(exc, grpc.RpcError):
                raise
            # Rendered once, as stored (and logged once, by map_rpc_error).
            raise error from exc
        except BaseException:
            await held._release()
            raise
        else:
            # A route that returned without storing (e.g. it replayed) must
            # not leave a placeholder behind.
            if held.replay is None:
                await held._release()

    async def _claim(self, request_hash: str) -> IdempotentRequest:
        for _ in range(2):
            try:
                return await self._claim_once(request_hash)
            except IntegrityError:
                continue  # a concurrent first use won the insert; read it now
        raise ApiError(409, "idempotency_request_in_progress", "A request with this Idempotency-Key is in progress.")

    async def _claim_once(self, request_hash: str) -> IdempotentRequest:
        now = time.time()
        async with self._db.transaction() as s:
            row = (
                await s.execute(
                    select(IdempotencyRow).where(
                        IdempotencyRow.org_id == self._org_id,
                        IdempotencyRow.idem_key == self.key,
                        IdempotencyRow.method == self._method,
                        IdempotencyRow.path == self._path,
                    )
                )
            ).scalar_one_or_none()
            if row is not None:
                expired = row.completed_at is not None and row.completed_at < now - _RETENTION_S
                abandoned = row.status_code is None and row.created_at < now - self._stale_after_s
                if expired or abandoned:
                    await s.delete(row)
                    await s.flush()
                    row = None
            if row is not None:
                if row.request_hash != request_hash:
                    raise ApiError(
                        409,
                        "idempotency_key_reused",
                        "This Idempotency-Key was already used with a different request body.",
                        param="Idempotency-Key",
                        retryable=False,
                    )
                if row.status_code is None:
                    raise ApiError(
                        409,
                        "idempotency_request_in_progress",
                        "A request with this Idempotency-Key is in progress.",
                        retryable=True,
                    )
                stored = StoredResponse(row.status_code, row.media_type or "application/json", row.response_body or "")
                return IdempotentRequest(None, None, stored)
            placeholder = IdempotencyRow(
                org_id=self._org_id,
                idem_key=self.key,
                method=self._method,
                path=self._path,
                request_hash=request_hash,
                created_at=now,
            )
            s.add(placeholder)
            await s.flush()
            return IdempotentRequest(self._db, placeholder.id, None)


async def _idempotency(request: Request, principal: PrincipalDep, state: StateDep) -> Idempotency:
    key = request.headers.get(IDEMPOTENCY_HEADER)
    if key is not None:
        key = key.strip()
        if not key or len(key) > _MAX_KEY_LEN:
            raise ApiError(
                400, "validation_error", "Idempotency-Key must be 1 to 255 characters.", param="Idempotency-Key"
            )
    stale_after = max(60.0, 4 * state.settings.rpc_timeout_s)
    return Idempotency(state.db, principal.org_id, key, request.method, request.url.path, stale_after)


IdempotencyDep = Annotated[Idempotency, Depends(_idempotency)]
