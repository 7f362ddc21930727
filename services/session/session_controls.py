"""A session's controls: its review mode, its prompt cache TTL and its
spend budget.

``prompt_cache_options.ttl`` is a minimum lifetime for new prompt cache
entries; both "30m" and "12h" are met by the OpenAI API's extended
retention, so model calls send ``prompt_cache_retention: "24h"`` with the
session ID as ``prompt_cache_key`` (and nothing without a TTL).

``spend_control.limit`` is a budget in USD cents. Spend is the session's
token usage priced with the price table (``BERTH_MODEL_PRICES`` over
``DEFAULT_MODEL_PRICES``) at the session's current model, plus that of every
subagent's session under it (each at its own model), running turns included:
subagents spend their root session's budget, so delegating work does not
escape it. Before and after every model call the running turn's spend is
added to the rest of the tree's; once it reaches the limit the turn fails
with ``session_budget_exceeded`` (the SDK's code for a session that reached
its budget) without running that response's tool calls. A root session then
pauses: its status is ``budget_reached`` (announced by
``agent.session.budget_reached`` in place of ``agent.session.idle``), it
refuses new input with 409 ``spend_limit_reached`` and its queued turns wait
until an update raises the limit past the spend or removes it, which makes
it idle again. Lowering an idle session's limit to its spend pauses it.
``spend_control.consumed`` shows the tree's spend, rounded down to a cent.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import Table, and_, bindparam, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from berth.session.v1 import session_pb2
from services.core.errors import InvalidArgument, SpendLimitReached
from services.core.settings import DEFAULT_MODEL_PRICES, ModelPrice
from services.session.harness.io import TurnFailure
from services.session.models import SessionRow, SubagentRow, TurnRow
from services.session.states import RUNNING_TURN_STATUSES, SessionStatus
from services.session.wire import parse_usage

__all__ = [
    "PriceTable",
    "SessionControls",
    "SpendBudget",
    "BUDGET_ERROR_CODE",
    "budget_move",
    "budget_root",
    "consumed_cents",
    "refuse_input_past_limit",
    "tree_spend_cents",
]

BUDGET_ERROR_CODE = "session_budget_exceeded"
_REVIEW_MODES = frozenset({"none"})
# prompt_cache_options.ttl -> the retention that guarantees at least that long.
_CACHE_RETENTION = {"30m": "24h", "12h": "24h"}


class PriceTable:
    """Model -> price; a name prices itself and, failing an exact match, the
    models it prefixes (the longest such name wins)."""

    def __init__(self, overrides: Mapping[str, ModelPrice] | None = None) -> None:
        self._prices = {**DEFAULT_MODEL_PRICES, **(overrides or {})}

    def price(self, model: str) -> ModelPrice | None:
        if model in self._prices:
            return self._prices[model]
        names = [n for n in self._prices if model.startswith(n)]
        return self._prices[max(names, key=len)] if names else None

    def cost_cents(self, model: str, usage: Mapping[str, Any] | None) -> float:
        """The cost of ``usage`` (a ``TokenUsage`` dict) in USD cents; an
        unpriced model costs nothing (a budget on one is refused up front)."""
        price = self.price(model)
        if price is None or not usage:
            return 0.0
        cached = int((usage.get("input_tokens_details") or {}).get("cached_tokens") or 0)
        uncached = max(int(usage.get("input_tokens") or 0) - cached, 0)
        output = int(usage.get("output_tokens") or 0)
        usd = (uncached * price.input + cached * price.cached_input + output * price.output) / 1_000_000
        return usd * 100


@dataclass(frozen=True)
class SessionControls:
    """What a session stores in ``controls_json``."""

    review: str | None = None
    spend_limit_cents: int | None = None
    prompt_cache_ttl: str | None = None

    @classmethod
    def from_json(cls, raw: str) -> SessionControls:
        data = json.loads(raw) if raw else {}
        return cls(
            review=data.get("review"),
            spend_limit_cents=data.get("spend_limit_cents"),
            prompt_cache_ttl=data.get("prompt_cache_ttl"),
        )

    def to_json(self) -> str:
        data = {k: v for k, v in vars(self).items() if v is not None}
        return json.dumps(data) if data else ""

    @property
    def prompt_cache_retention(self) -> str | None:
        return _CACHE_RETENTION.get(self.prompt_cache_ttl or "")

    @classmethod
    def from_proto(cls, message: session_pb2.SessionControls) -> SessionControls:
        if message.review and message.review not in _REVIEW_MODES:
            raise InvalidArgument(f"review {message.review!r} is not supported", param="review")
        limit = message.spend_limit_cents if message.HasField("spend_limit_cents") else None
        if limit is not None and limit < 1:
            raise InvalidArgument("spend_control.limit must be at least 1 (USD cents)", param="spend_control.limit")
        if message.prompt_cache_ttl and message.prompt_cache_ttl not in _CACHE_RETENTION:
            raise InvalidArgument("prompt_cache_options.ttl must be 30m or 12h", param="prompt_cache_options.ttl")
        return cls(
            review=message.review or None, spend_limit_cents=limit, prompt_cache_ttl=message.prompt_cache_ttl or None
        )

    def updated(self, message: session_pb2.SessionControls, paths: set[str]) -> SessionControls:
        """These controls with the fields named in an update mask replaced."""
        new = SessionControls.from_proto(message)
        return SessionControls(
            review=new.review if "review" in paths else self.review,
            spend_limit_cents=new.spend_limit_cents if "spend_control" in paths else self.spend_limit_cents,
            prompt_cache_ttl=new.prompt_cache_ttl if "prompt_cache_options" in paths else self.prompt_cache_ttl,
        )

    def check_priced(self, prices: PriceTable, model: str) -> None:
        """A budget needs a price for the session's model."""
        if self.spend_limit_cents is not None and prices.price(model) is None:
            raise InvalidArgument(
                f"no price is configured for model {model!r} (BERTH_MODEL_PRICES)", param="spend_control.limit"
            )

    def to_proto(self) -> session_pb2.SessionControls:
        out = session_pb2.SessionControls(review=self.review or "", prompt_cache_ttl=self.prompt_cache_ttl or "")
        if self.spend_limit_cents is not None:
            out.spend_limit_cents = self.spend_limit_cents
        return out


class SpendBudget:
    """One turn's view of its budget: the limit of its tree's root session
    and what the tree spent outside this turn, read again before every
    model call (a subagent or the parent may have spent meanwhile)."""

    def __init__(
        self,
        limit_cents: int,
        prices: PriceTable,
        model: str,
        read_elsewhere: Callable[[], Awaitable[float]],
    ) -> None:
        self.limit_cents = limit_cents
        self.spent_elsewhere_cents = 0.0
        self._prices = prices
        self._model = model
        self._read_elsewhere = read_elsewhere

    async def refresh(self) -> None:
        self.spent_elsewhere_cents = await self._read_elsewhere()

    def check(self, turn_usage: Mapping[str, Any] | None) -> None:
        """Ends the turn once the tree's spend reaches the limit."""
        spent = self.spent_elsewhere_cents + self._prices.cost_cents(self._model, turn_usage)
        if spent >= self.limit_cents:
            raise TurnFailure(BUDGET_ERROR_CODE, _reached(self.limit_cents, spent))


def _reached(limit: int, spent: float) -> str:
    return f"the session reached its spend_control limit of {limit} USD cents ({spent:.2f} spent)"


def _model(agent_config_json: str) -> str:
    return str((json.loads(agent_config_json or "{}").get("config") or {}).get("model") or "")


async def budget_root(s: AsyncSession, row: SessionRow) -> SessionRow:
    """The session whose ``spend_control`` a session spends against: itself,
    or for a subagent's session the root of its tree."""
    if row.subagent_id is None:
        return row
    root_id = (
        await s.execute(select(SubagentRow.root_session_id).where(SubagentRow.id == row.subagent_id))
    ).scalar_one_or_none()
    root = await s.scalar(select(SessionRow).where(SessionRow.id == root_id, SessionRow.org_id == row.org_id))
    return root if root is not None else row


_SESSIONS = cast(Table, SessionRow.__table__)
_TURNS = cast(Table, TurnRow.__table__)
_SUBAGENTS = cast(Table, SubagentRow.__table__)
# Each session of a tree with its running turn, if any (a session runs one
# turn at a time), but the excepted turn's. Built once: building a statement
# costs more CPU than running it on SQLite, and this runs at every session
# view and before every model call of a budgeted turn.
_TREE_SPEND = (
    select(_SESSIONS.c.id, _SESSIONS.c.usage_json, _SESSIONS.c.agent_config_json, _TURNS.c.usage_json.label("turn_usage"))
    .select_from(
        _SESSIONS.outerjoin(
            _TURNS,
            and_(
                _TURNS.c.session_id == _SESSIONS.c.id,
                _TURNS.c.status.in_(RUNNING_TURN_STATUSES),
                _TURNS.c.id != bindparam("except_turn_id"),
            ),
        )
    )
    .where(
        _SESSIONS.c.org_id == bindparam("org_id"),
        or_(
            _SESSIONS.c.id == bindparam("root_id"),
            _SESSIONS.c.id.in_(
                select(_SUBAGENTS.c.child_session_id).where(
                    _SUBAGENTS.c.org_id == bindparam("org_id"), _SUBAGENTS.c.root_session_id == bindparam("root_id")
                )
            ),
        ),
    )
)


async def tree_spend_cents(s: AsyncSession, root: SessionRow, prices: PriceTable, *, except_turn_id: str = "") -> float:
    """What the tree of ``root`` (the root session and every subagent's
    session under it) has spent: its sessions' finished turns, each priced
    at its session's model, and the usage their running turns have saved so
    far, but ``except_turn_id``'s, which that turn counts itself."""
    rows = (
        await s.execute(_TREE_SPEND, {"org_id": root.org_id, "root_id": root.id, "except_turn_id": except_turn_id})
    ).all()
    models = {r.id: _model(r.agent_config_json) for r in rows}
    finished = {r.id: r.usage_json for r in rows}
    spent = sum(prices.cost_cents(models[i], parse_usage(usage)) for i, usage in finished.items())
    return spent + sum(prices.cost_cents(models[r.id], parse_usage(r.turn_usage)) for r in rows if r.turn_usage is not None)


async def refuse_input_past_limit(s: AsyncSession, row: SessionRow, prices: PriceTable) -> None:
    """New input is refused once the session's tree reached its limit, and
    while its root is paused there."""
    root = await budget_root(s, row)
    limit = SessionControls.from_json(root.controls_json).spend_limit_cents
    if limit is None:
        return
    spent = await tree_spend_cents(s, root, prices)
    if spent >= limit or root.status == SessionStatus.BUDGET_REACHED:
        raise SpendLimitReached(_reached(limit, spent), param="spend_control.limit")


async def consumed_cents(s: AsyncSession, row: SessionRow, prices: PriceTable) -> int | None:
    """``spend_control.consumed``: what a root session's tree has spent, in
    whole cents rounded down; None (unavailable) for a subagent's session
    (its root's budget holds its spend) or a session on an unpriced model."""
    if row.subagent_id is not None or prices.price(_model(row.agent_config_json)) is None:
        return None
    return math.floor(await tree_spend_cents(s, row, prices))


async def budget_move(s: AsyncSession, row: SessionRow, prices: PriceTable) -> SessionStatus | None:
    """The status a changed ``spend_control`` moves a root session with no
    turn running to: paused once its tree has spent the new limit, idle again
    once a paused session's limit was raised past its spend or removed.
    None when its status stays."""
    if row.subagent_id is not None or row.active_turn_id is not None:
        return None
    if row.status not in (SessionStatus.IDLE, SessionStatus.BUDGET_REACHED):
        return None
    limit = SessionControls.from_json(row.controls_json).spend_limit_cents
    reached = limit is not None and await tree_spend_cents(s, row, prices) >= limit
    status = SessionStatus.BUDGET_REACHED if reached else SessionStatus.IDLE
    return status if status != row.status else None
