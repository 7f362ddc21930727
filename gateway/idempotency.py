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
outcome, stored like a success, so an SDK retry replays it instead of
creating a duplicate (replayed errors say ``x-should-retry: false``). Whether
it may have written is read off the calls it made (``AttemptInterceptor``):
it did if a call that is not a read succeeded, or failed in a way that does
not prove the service did nothing (an internal error, a deadline, a
connection lost mid-call). A call refused whole (a domain error: invalid,
not found, conflict, the service saying it is unavailable) or never sent
(``PeerUnreachable``: no connection within the gateway's wait) wrote
nothing. An attempt that wrote nothing releases the key, whatever its
status, so a retry runs again, as does a request cancelled by its client
before it wrote. Records expire after a day; a placeholder whose request
died is taken over after a few deadlines.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Annotated, Any

import grpc
from fastapi import Depends, Request
from fastapi.responses import Response
from grpc_status import rpc_status
from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError

from gateway.auth import PrincipalDep
from gateway.errors import ApiError, error_response, internal_error, map_rpc_error
from gateway.models import IdempotencyRow
from gateway.state import StateDep
from services.core.db import Database
from services.core.grpc_client import PeerUnreachable

__all__ = [
    "IDEMPOTENCY_HEADER",
    "StoredResponse",
    "IdempotentRequest",
    "Idempotency",
    "IdempotencyDep",
    "AttemptInterceptor",
]

IDEMPOTENCY_HEADER = "idempotency-key"
_MAX_KEY_LEN = 255
_RETENTION_S = 24 * 3600.0


@dataclass
class _Attempt:
    wrote: bool = False


_attempt: ContextVar[_Attempt | None] = ContextVar("berth_idempotent_attempt", default=None)

# Failures that leave the service's state unknown: it may have committed.
_UNKNOWN_OUTCOME = frozenset(
    {
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DATA_LOSS,
    }
)


def _did_nothing(exc: BaseException) -> bool:
    """Whether a failed call proves the service wrote nothing: it was never
    sent, or the service refused it with a domain error (its rich status),
    not one of the failures that leave the outcome unknown. A bare status
    (no rich details) is the transport's: the connection broke mid-call."""
    if isinstance(exc, PeerUnreachable):
        return True
    if not isinstance(exc, grpc.aio.AioRpcError) or exc.code() in _UNKNOWN_OUTCOME:
        return False
    try:
        return rpc_status.from_call(exc) is not None
    except ValueError:
        return False


class AttemptInterceptor(grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    """Notes, for the keyed request it runs in, each call that may have
    written: any call but ``reads`` (methods their protos mark idempotent or
    free of side effects, so repeating them is harmless) that succeeded or
    failed without proof it did nothing. Put it first on the channel."""

    def __init__(self, reads: Iterable[tuple[str, str]]) -> None:
        self._reads = frozenset(f"/{service}/{method}" for service, method in reads)

    def _tracked(self, client_call_details: Any) -> _Attempt | None:
        attempt = _attempt.get()
        method = client_call_details.method
        name = method.decode() if isinstance(method, bytes) else str(method)
        return None if attempt is None or name in self._reads else attempt

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        attempt = self._tracked(client_call_details)
        if attempt is None:
            return await continuation(client_call_details, request)
        try:
            call = await continuation(client_call_details, request)
            response = await call
        except BaseException as exc:
            if not _did_nothing(exc):
                attempt.wrote = True
            raise
        attempt.wrote = True
        return response

    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        attempt = self._tracked(client_call_details)
        if attempt is not None:
            # No write streams today; one would count as written once sent.
            attempt.wrote = True
        return await continuation(client_call_details, request)


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
        attempt = _Attempt()
        token = _attempt.set(attempt)
        try:
            yield held
        except Exception as exc:
            error = exc if isinstance(exc, ApiError) else map_rpc_error(exc) if isinstance(exc, grpc.RpcError) else internal_error()
            if attempt.wrote:
                await held.store(error.status, bytes(error_response(error).body).decode())
            else:
                await held._release()
            if error is exc or not isinstance(exc, grpc.RpcError):
                raise
            # Rendered once, as stored (and logged once, by map_rpc_error).
            raise error from exc
        except BaseException:
            # Cancelled: a write already made binds the key to an outcome the
            # client never saw; report it as the internal error it is.
            if attempt.wrote:
                error = internal_error()
                await held.store(error.status, bytes(error_response(error).body).decode())
            else:
                await held._release()
            raise
        else:
            # A route that returned without storing (e.g. it replayed) must
            # not leave a placeholder behind.
            if held.replay is None:
                await held._release()
        finally:
            _attempt.reset(token)

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
