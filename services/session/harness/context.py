"""How large a model's context window is, how much of it a request fills,
and what a compaction leaves of the history.

A compaction is an item whose one transcript entry is the summary, given to
the model as a user message and marked with the IDs of the items it keeps
(``{"role": "user", "text": ..., "compaction": {"keep": [ID, ...]}}``):
the newest items, which it did not summarize, and those added while it
ran. From then on the model sees that entry, the kept items and every item
after it, in place of everything before; ``compact_history`` applies every
compaction of a history in order, so a turn loaded after a restart (or
from the session's ``context_from_pk``, the oldest item still seen) sees
what the turn that compacted saw."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from services.session.harness.models.base import Entry, ModelRequest

__all__ = [
    "ContextLimits",
    "KNOWN_CONTEXT_WINDOWS",
    "context_window",
    "estimate_tokens",
    "estimate_entries",
    "TokenEstimator",
    "compaction_entry",
    "compaction_keep",
    "compact_history",
]

# Context windows (tokens) of known model families, by name prefix.
KNOWN_CONTEXT_WINDOWS: Mapping[str, int] = {
    "gpt-5": 400_000,
    "gpt-4.1": 1_047_576,
    "gpt-4o": 128_000,
    "gpt-4-turbo": 128_000,
    "gpt-4": 8_192,
    "gpt-3.5-turbo": 16_385,
    "o1": 200_000,
    "o3": 200_000,
    "o4-mini": 200_000,
    "codex-": 400_000,
    "gpt-oss": 131_072,
    "claude": 200_000,
    "llama3": 8_192,
    "llama-3.1": 131_072,
    "qwen2.5": 32_768,
    "qwen3": 40_960,
    "mistral": 32_768,
    "deepseek": 131_072,
    "gemini": 1_048_576,
}

# Rough bytes per token of JSON text, and a per-entry allowance for the
# message framing the APIs add.
_CHARS_PER_TOKEN = 4
_ENTRY_OVERHEAD = 4


def context_window(model: str, configured: Mapping[str, int], default: int) -> int:
    """The window of ``model``: the longest matching prefix of the configured
    windows, else of the known ones, else ``default``."""
    for table in (configured, KNOWN_CONTEXT_WINDOWS):
        matches = [prefix for prefix in table if model.startswith(prefix)]
        if matches:
            return int(table[max(matches, key=len)])
    return default

@dataclass(frozen=True)
class ContextLimits:
    """Context windows per model (``context.context_window``) and the
    fraction of one a request may fill before it is compacted."""

    windows: Mapping[str, int] = field(default_factory=dict)
    default_window: int = 128_000
    threshold: float = 0.8

    def window(self, model: str) -> int:
        return context_window(model, self.windows, self.default_window)


def _chars(value: object) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False))


class TokenEstimator:
    """Token estimates of requests, remembering each transcript entry's
    serialized size by identity: a transcript grows by a few entries per
    model call, so only those are serialized again. An entry is never
    changed in place once it is in a transcript (the turn's writer replaces
    an item's entries), and each remembered size holds its entry, so an
    identity cannot be reused while it is remembered.

    One per session: the history cache keeps it between turns with the
    entries it sized (``HistoryCache.estimator``), so a turn of a long
    conversation serializes only what is new. Each turn start keeps (``retain``)
    only the sizes of the history it starts from, so what it remembers stays
    bounded by the conversation plus one turn's entries."""

    def __init__(self) -> None:
        self._sizes: dict[int, tuple[Entry, int]] = {}

    def _entry(self, entry: Entry) -> int:
        known = self._sizes.get(id(entry))
        if known is not None and known[0] is entry:
            return known[1]
        tokens = _chars(entry) // _CHARS_PER_TOKEN + _ENTRY_OVERHEAD
        self._sizes[id(entry)] = (entry, tokens)
        return tokens

    def entries(self, entries: list[Entry]) -> int:
        """Estimated tokens of transcript entries."""
        return sum(self._entry(e) for e in entries)

    def retain(self, entries: Iterable[Entry]) -> None:
        """Forgets every size but those of ``entries`` (a transcript as it
        is now: what was compacted or replaced is no longer held)."""
        sizes = self._sizes
        self._sizes = {id(e): sizes[id(e)] for e in entries if id(e) in sizes and sizes[id(e)][0] is e}

    def request(self, request: ModelRequest) -> int:
        """Estimated tokens of a whole request: instructions, tool
        definitions and transcript."""
        fixed = len(request.instructions or "") + sum(
            len(t.name) + len(t.description) + _chars(t.parameters) for t in request.tools
        )
        return fixed // _CHARS_PER_TOKEN + self.entries(request.transcript)


def estimate_entries(entries: list[Entry]) -> int:
    """Estimated tokens of transcript entries."""
    return TokenEstimator().entries(entries)


def estimate_tokens(request: ModelRequest) -> int:
    """Estimated tokens of a whole request: instructions, tool definitions
    and transcript."""
    return TokenEstimator().request(request)


def compaction_entry(text: str, keep: list[str]) -> Entry:
    return {"role": "user", "text": text, "compaction": {"keep": list(keep)}}


def compaction_keep(entries: list[Entry]) -> list[str] | None:
    """The items a compaction kept, when ``entries`` are a compaction's."""
    if len(entries) != 1:
        return None
    marker = entries[0].get("compaction")
    return [str(i) for i in marker.get("keep") or ()] if isinstance(marker, dict) else None


def compact_history(items: list[tuple[str, list[Entry]]]) -> list[tuple[str, list[Entry]]]:
    """The items the model sees: each compaction drops the items before it
    but those it kept."""
    out: list[tuple[str, list[Entry]]] = []
    for item_id, entries in items:
        keep = compaction_keep(entries)
        if keep is None:
            out.append((item_id, entries))
            continue
        kept = set(keep)
        out = [(item_id, entries), *(pair for pair in out if pair[0] in kept)]
    return out
