"""A Ctrl-C that lands while Python builds a class (a lazily imported module's dataclass, as
rich's `Column` when a command first prints a table) reaches the CLI wrapped: CPython 3.11
re-raises an exception from `__set_name__` as a RuntimeError whose cause is the interrupt.
It is still an interrupt — exit 130 and the interrupt's line, never "internal error"."""

from __future__ import annotations

from outbox_migrate.cli import exits, signals


class _InterruptedDescriptor:
    def __set_name__(self, owner: type, name: str) -> None:
        raise KeyboardInterrupt


def _interrupt_while_building_a_class() -> BaseException:
    try:
        type("Column", (), {"_cells": _InterruptedDescriptor()})
    except BaseException as exc:  # whatever CPython raised: the test inspects it
        return exc
    raise AssertionError("the class was built")


def test_an_interrupt_wrapped_by_class_creation_exits_as_an_interrupt() -> None:
    caught = _interrupt_while_building_a_class()
    code, message = exits.classify(caught)
    assert code == signals.INTERRUPTED_EXIT, (type(caught).__name__, message)
    assert "internal error" not in message
    assert message.startswith("interrupted during")


def test_an_error_without_an_interrupt_in_its_chain_stays_an_internal_error() -> None:
    try:
        try:
            raise ValueError("inner")
        except ValueError as inner:
            raise RuntimeError("outer") from inner
    except RuntimeError as exc:
        code, message = exits.classify(exc)
    assert code == 1
    assert message.startswith("internal error: outer")
