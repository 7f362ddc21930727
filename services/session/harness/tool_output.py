"""How much of a tool's output the model and the item get, and the
transcript entries of a finished tool call: one home for the environment
tools (``tools.py``, ``coding_tools.py``)."""

from __future__ import annotations

from typing import Any

from services.session.harness.models.base import ToolCall

__all__ = ["MAX_ITEM_OUTPUT", "MAX_MODEL_OUTPUT", "clip_for_model", "call_entries"]

# The most output characters an item stores.
MAX_ITEM_OUTPUT = 256 * 1024
# The most output characters the model is given for one tool call.
MAX_MODEL_OUTPUT = 16 * 1024


def clip_for_model(text: str) -> str:
    """``text`` when it fits, else its head and tail around a note that
    tells the model how much was left out."""
    if len(text) <= MAX_MODEL_OUTPUT:
        return text
    half = MAX_MODEL_OUTPUT // 2
    omitted = len(text) - 2 * half
    return (
        f"{text[:half]}\n...[output truncated: a tool result gives you at most {MAX_MODEL_OUTPUT} characters, "
        f"so {omitted} of its {len(text)} characters were omitted from the middle; narrow the command "
        f"(e.g. grep, head, tail or a line range) to see them]...\n"
        f"{text[-half:]}"
    )


def call_entries(call: ToolCall, output: str, **extra: Any) -> list[dict[str, Any]]:
    """The assistant's call and the tool's answer, as transcript entries;
    ``extra`` keys are kept on the answer for the harness (models do not see them)."""
    return [
        {"role": "assistant", "tool_calls": [call.as_entry()]},
        {"role": "tool", "call_id": call.id, "output": output, **extra},
    ]
