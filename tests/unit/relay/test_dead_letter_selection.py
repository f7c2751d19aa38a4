"""Pure parts of the dead-letters command: which dead letters a selection names, and which
table a dead letter goes back to."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from outbox_migrate.config import OutboxSpec
from outbox_migrate.errors import UsageError
from outbox_migrate.relay.dead_letters import Selection, _target, purge


def test_an_empty_selection_is_refused_before_any_statement() -> None:
    assert Selection().empty
    with pytest.raises(UsageError, match="purge needs a selection"):
        purge(object(), "public", "outbox_dead_letter", Selection())


def test_every_criterion_is_a_bound_parameter() -> None:
    since = datetime(2026, 11, 1, tzinfo=UTC)
    where, params = Selection(("42", "x'y"), "23505", since, None, "public.outbox").where()
    text = where.as_string(None)
    assert "x'y" not in text and "23505" not in text  # values travel as parameters
    assert params == {"ids": ["42", "x'y"], "reason": "23505", "since": since,
                      "source": "public.outbox"}  # fmt: skip


def test_a_dead_letter_goes_back_where_the_relay_reads() -> None:
    spec = OutboxSpec()
    assert _target("public.outbox_new copy 2", spec, migrated=True) == "public.outbox_new"
    assert _target("public.outbox", spec, migrated=False) == "public.outbox"
    assert _target("public.outbox", spec, migrated=True) == "public.outbox_new"
