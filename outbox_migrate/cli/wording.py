"""Small words for people-facing lines: counts with the right plural ("1 step", "2 steps").

Kept apart from console.py so commands can build their sentences without importing rich.
"""

from __future__ import annotations


def count(number: int, noun: str, plural: str | None = None) -> str:
    """`count(1, "step")` → "1 step"; `count(3, "step")` → "3 steps"."""
    word = noun if number == 1 else (plural or noun + "s")
    return f"{number:,} {word}"


def without_prefix(message: str, prefix: str) -> str:
    """`message` without a leading `prefix: ` (a step id the line already names)."""
    lead = prefix + ": "
    return message[len(lead) :] if message.startswith(lead) else message
