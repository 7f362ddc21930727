"""The model-facing history a session's next turn starts from, kept between
turns, so that starting a turn reads (and JSON-decodes) only the items added
since the session's last turn start here, not the whole conversation.

Sound because an item's model entries never change once its turn has ended
(they change only while their turn runs: its writer, a takeover of it, and
its ending transaction), and a turn starts only under the session's mutex,
when no turn of the session runs. What is kept is checked at every start:
the session's compaction point (``context_from_pk``) must be unchanged, and
the number of the session's items from it must be what was kept plus what
was read; otherwise (a compaction, or items that became visible out of
primary-key order) the whole history is read again. Bounded: the sessions
whose turns started least recently are dropped first.

Each kept session also keeps its token estimator (``estimator``), which
remembers the sizes of the entries kept here, so compaction's estimate of a
turn's first request serializes only the items added since."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import cast

from sqlalchemy import Table, bindparam, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from services.session.harness.context import TokenEstimator
from services.session.harness.models.base import Entry
from services.session.models import ItemRow

__all__ = ["HistoryCache"]

_ITEMS = cast(Table, ItemRow.__table__)
_SESSION_FROM = (_ITEMS.c.session_id == bindparam("session_id"), _ITEMS.c.pk >= bindparam("from_pk"))
# Built once (see services/session/repository.py on prepared statements).
_HISTORY = select(_ITEMS.c.pk, _ITEMS.c.id, _ITEMS.c.model_json).where(*_SESSION_FROM).order_by(_ITEMS.c.pk)
_HISTORY_AFTER = _HISTORY.where(_ITEMS.c.pk > bindparam("after_pk"))
_COUNT = select(func.count()).select_from(_ITEMS).where(*_SESSION_FROM)

History = list[tuple[str, list[Entry]]]


@dataclass(frozen=True)
class _Kept:
    context_from_pk: int
    last_pk: int
    items: History
    # The session's token estimator, which sizes these items' entries.
    estimator: TokenEstimator


class HistoryCache:
    def __init__(self, max_sessions: int = 512) -> None:
        self._max_sessions = max_sessions
        self._kept: OrderedDict[str, _Kept] = OrderedDict()

    async def read(self, s: AsyncSession, session_id: str, context_from_pk: int) -> History:
        """The session's items from its compaction point, as (item ID, model
        entries) in order: a new list the caller may change."""
        params = {"session_id": session_id, "from_pk": context_from_pk}
        kept = self._kept.pop(session_id, None)
        estimator = kept.estimator if kept is not None else TokenEstimator()
        if kept is not None and kept.context_from_pk == context_from_pk:
            rows = (await s.execute(_HISTORY_AFTER, {**params, "after_pk": kept.last_pk})).all()
            total = int((await s.execute(_COUNT, params)).scalar_one())
            if total == len(kept.items) + len(rows):
                items = kept.items + [(r.id, json.loads(r.model_json)) for r in rows]
                last_pk = rows[-1].pk if rows else kept.last_pk
                return self._keep(session_id, _Kept(context_from_pk, last_pk, items, estimator))
        rows = (await s.execute(_HISTORY, params)).all()
        items = [(r.id, json.loads(r.model_json)) for r in rows]
        return self._keep(session_id, _Kept(context_from_pk, rows[-1].pk if rows else -1, items, estimator))

    def estimator(self, session_id: str) -> TokenEstimator:
        """The session's token estimator, which remembers the sizes of the
        entries it has estimated; kept as long as the session's history is
        (a new one for a session not kept)."""
        kept = self._kept.get(session_id)
        return kept.estimator if kept is not None else TokenEstimator()

    def forget(self, session_id: str) -> None:
        self._kept.pop(session_id, None)

    def _keep(self, session_id: str, kept: _Kept) -> History:
        # Sizes of entries compacted away or replaced are not held any longer.
        kept.estimator.retain(entry for _, entries in kept.items for entry in entries)
        self._kept[session_id] = kept
        while len(self._kept) > self._max_sessions:
            self._kept.popitem(last=False)
        return list(kept.items)
