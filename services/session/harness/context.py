"""How large a model's context window is, how much of it a request fills,
and what a compaction leaves of the history.

A compaction is an item whose one transcript entry is the summary, given to
the model as a user message and marked with the ID of the last item it
summarized (``{"role": "user", "text": ..., "compaction": {"through": ID}}``).
From then on the model sees that entry followed by the items after the
marked one, in place of everything up to it; ``compact_history`` applies
every compaction of a history in order, so a turn loaded after a restart
sees what the turn that compacted saw."""

from __future__ import annotations

import json
from collections.abc import Mapping

from services.session.harness.models.base import Entry, ModelRequest

__all__ = [
    "KNOWN_CONTEXT_WINDOWS",
    "context_window",
    "estimate_tokens",
    "estimate_entries",
    "compaction_entry",
    "compaction_through",
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


def _chars(value: object) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False))


def estimate_entries(entries: list[Entry]) -> int:
    """Estimated tokens of transcript entries."""
    return sum(_chars(e) // _CHARS_PER_TOKEN + _ENTRY_OVERHEAD for e in entries)


def estimate_tokens(request: ModelRequest) -> int:
    """Estimated tokens of a whole request: instructions, tool definitions
    and transcript."""
    fixed = len(request.instructions or "") + sum(
        len(t.name) + len(t.description) + _chars(t.parameters) for t in request.tools
    )
    return fixed // _CHARS_PER_TOKEN + estimate_entries(request.transcript)


def compaction_entry(text: str, through: str) -> Entry:
    return {"role": "user", "text": text, "compaction": {"through": through}}


def compaction_through(entries: list[Entry]) -> str | None:
    """The last item a compaction summarized, when ``entries`` are a compaction's."""
    if len(entries) != 1:
        return None
    marker = entries[0].get("compaction")
    return str(marker["through"]) if isinstance(marker, dict) and marker.get("through") else None


def compact_history(items: list[tuple[str, list[Entry]]]) -> list[tuple[str, list[Entry]]]:
    """The items the model sees: each compaction replaces the items up to
    the one it names (the items added while it ran stay after it)."""
    out: list[tuple[str, list[Entry]]] = []
    for item_id, entries in items:
        through = compaction_through(entries)
        if through is None:
            out.append((item_id, entries))
            continue
        ids = [i for i, _ in out]
        kept = out[ids.index(through) + 1 :] if through in ids else out
        out = [(item_id, entries), *kept]
    return out
