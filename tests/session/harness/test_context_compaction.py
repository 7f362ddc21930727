"""The pure parts of context management: context windows by model name,
what a compaction leaves of a history, and the note on clipped tool output."""

from __future__ import annotations

from services.session.harness.context import (
    ContextLimits,
    compact_history,
    compaction_entry,
    context_window,
    estimate_entries,
)
from services.session.harness.tool_output import MAX_MODEL_OUTPUT, clip_for_model


def _item(n: int) -> tuple[str, list[dict[str, str]]]:
    return (f"item_{n}", [{"role": "user", "text": f"message {n}"}])


def test_a_configured_window_wins_over_the_known_family_and_the_longest_prefix_wins() -> None:
    assert context_window("gpt-4o-mini", {}, 1000) == 128_000
    assert context_window("gpt-4-0613", {}, 1000) == 8_192
    assert context_window("gpt-4o-mini", {"gpt-4o": 50_000, "gpt-4o-mini": 20_000}, 1000) == 20_000
    assert context_window("my-local-model", {}, 4096) == 4096
    assert ContextLimits(windows={"my-": 9000}).window("my-local-model") == 9000


def test_a_compaction_replaces_the_items_before_it_but_those_it_kept() -> None:
    history = [_item(1), _item(2), _item(3)]
    summary = ("item_c", [compaction_entry("summary", ["item_3"])])
    # item_4 was added while the compaction ran, before its item.
    compacted = compact_history([*history, _item(4), summary, _item(5)])
    assert [i for i, _ in compacted] == ["item_c", "item_3", "item_5"]


def test_compactions_apply_in_order_also_to_a_history_loaded_from_the_middle() -> None:
    first = ("item_c1", [compaction_entry("one", ["item_2", "item_3"])])
    second = ("item_c2", [compaction_entry("two", ["item_4"])])
    full = [_item(1), _item(2), _item(3), first, _item(4), second, _item(5)]
    assert [i for i, _ in compact_history(full)] == ["item_c2", "item_4", "item_5"]
    # Loaded from the oldest item still seen (item_4): the same view.
    assert compact_history(full[4:]) == compact_history(full)


def test_a_history_without_compactions_is_unchanged_and_estimated_by_its_size() -> None:
    history = [_item(1), _item(2)]
    assert compact_history(history) == history
    small, large = estimate_entries([{"text": "x"}]), estimate_entries([{"text": "x" * 4000}])
    assert abs(large - small - 1000) <= 1


def test_clipped_tool_output_tells_the_model_the_limit_and_how_much_was_left_out() -> None:
    text = "a" * (3 * MAX_MODEL_OUTPUT)
    clipped = clip_for_model(text)
    assert len(clipped) < len(text) and clipped.startswith("a" * 100) and clipped.endswith("a" * 100)
    assert f"at most {MAX_MODEL_OUTPUT} characters" in clipped
    assert f"{len(text) - MAX_MODEL_OUTPUT} of its {len(text)} characters were omitted" in clipped
    assert clip_for_model("short") == "short"
