"""A claim session's statements: rendered once per session, source and shard layout, and
prepared on it before the pipeline starts (PQprepare is synchronous).

Rendering and preparing cost more than a small batch's SQL, so both happen once per session.
"""

from __future__ import annotations

from typing import Any

from outbox_migrate.relay import queries, wire

HORIZON = queries.horizon().as_string().encode()
IDLE_UNLOCK = queries.named("idle-unlock").as_string().encode()
TRY_IDLE_LOCK = queries.try_idle_lock().as_string().encode()


class Statements:
    """Claim, gap probe and mark of each source, for one claim session."""

    def __init__(self, columns: dict[str, queries.Columns], *, by_key: bool, text_ids: bool):
        self._columns = columns
        self._by_key = by_key
        self._text_ids = text_ids
        self._rendered: dict[tuple[str, bool], tuple[bytes, bytes, bytes]] = {}

    def reset(self) -> None:
        """A new session: nothing is prepared on it yet."""
        self._rendered.clear()

    def of(
        self, conn: Any, pipe: wire.Wire, source: queries.Source, sharded: bool
    ) -> tuple[bytes, bytes, bytes]:
        """(claim, gap probe, mark) of `source`, prepared on `pipe`'s session."""
        key = (source.label, sharded)
        rendered = self._rendered.get(key)
        if rendered is None:
            columns = self._columns[source.label]
            claim = queries.claim(source, columns, sharded=sharded, by_key=self._by_key)
            rendered = (
                claim.as_bytes(conn),
                queries.probe(source, columns).as_bytes(conn),
                queries.mark(source).as_bytes(conn),
            )
            self._rendered[key] = rendered
            # The gap probe and the horizon only where the cursor uses them (integer ids).
            used = [rendered[0], rendered[2], IDLE_UNLOCK, TRY_IDLE_LOCK]
            if not self._text_ids:
                used += [rendered[1], HORIZON]
            for statement in used:
                pipe.prepare(statement)
        return rendered
