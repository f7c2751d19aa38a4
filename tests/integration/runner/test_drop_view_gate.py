"""The drop-view gate against a writer a lock sample cannot see: the previous version inserting
back to back through the compatibility view, each insert its own short transaction.

Found in the field: such a writer showed a lock on the view in 3.5 % of `pg_locks` polls (0.7 %
with prepared statements); the gate passed and the view was dropped under it, and every later
insert failed. The gate now counts the writes (kinds/original_name.py `count-view-writes`):
it never passes while they go on, and the writer never sees an error. Run as the roles the docs
name: the runner as the table's owner, the writer as the application's role.
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox

from outbox_migrate.errors import PreconditionFailed
from outbox_migrate.runner import Runner
from tests.integration.runner.test_original_name import relkinds, run_through_base, settings
from tests.support.roles import DocumentedRoles

ATTEMPTS = 20
FAST_GATE = {"gate_window_s": 0.1}
INSERT = "INSERT INTO outbox_new (event_type, payload) VALUES ('e', '{}')"


class ViewWriter:
    """The previous version: inserts through the view back to back until stopped."""

    def __init__(self, dsn: str, *, prepared: bool) -> None:
        self.dsn, self.prepared = dsn, prepared
        self.inserted = 0
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True, application_name="previous") as conn:
            # Simple query protocol for the unprepared writer: an extra result sent by the
            # counting rule would show up here as a protocol surprise.
            cursor: Any = conn.cursor() if self.prepared else psycopg.ClientCursor(conn)
            while not self.stop.is_set():
                try:
                    cursor.execute(INSERT, prepare=True) if self.prepared else cursor.execute(
                        INSERT
                    )
                    self.inserted += 1
                except psycopg.Error as exc:
                    self.errors.append(str(exc).splitlines()[0])
                    self.stop.wait(0.01)

    def __enter__(self) -> ViewWriter:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)


@pytest.mark.newest_pg_only
@pytest.mark.parametrize("prepared", [False, True], ids=["simple", "prepared"])
def test_a_busy_writer_through_the_view_keeps_the_drop_from_passing(
    dsn: str, roles: DocumentedRoles, prepared: bool
) -> None:
    with psycopg.connect(roles.owner_dsn, autocommit=True) as owner:
        create_flat_outbox(owner)
        roles.grant("SELECT, INSERT, UPDATE", "outbox", roles.app)
        run_through_base(owner, roles.owner_dsn, "copra")
        with Runner(roles.owner_dsn, settings(), "copra", include_optional=True) as runner:
            runner.run("original-name")
        refused = 0
        with ViewWriter(roles.app_dsn, prepared=prepared) as writer:
            for _ in range(ATTEMPTS):
                with (
                    Runner(
                        roles.owner_dsn, settings(**FAST_GATE), "copra", include_optional=True
                    ) as runner,
                    pytest.raises(PreconditionFailed, match=r"outbox_new.*still written through"),
                ):
                    runner.run("drop-view")
                refused += 1
                assert relkinds(owner)["outbox_new"] == "v"
            inserted = writer.inserted
        assert refused == ATTEMPTS
        assert writer.errors == []
        assert inserted > 100  # it did write back to back all along
        with Runner(roles.owner_dsn, settings(**FAST_GATE), "copra", include_optional=True) as r:
            assert r.run("drop-view").completed
        assert relkinds(owner)["outbox_new"] is None
        leftovers = owner.execute(
            "SELECT count(*) FROM pg_class WHERE relname IN "
            "('outbox_new_view_uses', 'outbox_new_view_use_sink')"
        ).fetchone()
        assert leftovers == (0,)
        assert owner.execute("SELECT to_regproc('outbox_new_view_use_tick')").fetchone() == (None,)


@pytest.mark.pg_edges
def test_writes_through_the_counted_view_work_as_before_and_each_statement_counts(
    dsn: str, roles: DocumentedRoles
) -> None:
    """The counting rules leave the automatic update alone: RETURNING, ON CONFLICT and a mark
    through the view work for the application's role, which was granted nothing new."""
    with psycopg.connect(roles.owner_dsn, autocommit=True) as owner:
        create_flat_outbox(owner)
        roles.grant("SELECT, INSERT, UPDATE", "outbox", roles.app)
        run_through_base(owner, roles.owner_dsn, "copra")
        with Runner(roles.owner_dsn, settings(), "copra", include_optional=True) as runner:
            runner.run("original-name")
            assert runner.next().ran == ["copra.drop-view.count-view-writes"]

        def uses() -> int:
            row = owner.execute("SELECT pg_sequence_last_value('outbox_new_view_uses')").fetchone()
            return int(row[0] or 0) if row else 0

        with psycopg.connect(roles.app_dsn, autocommit=True) as app:
            before = app.execute("SELECT count(*) FROM outbox_new").fetchone()
            rows = int(before[0]) if before else 0
            row = app.execute(f"{INSERT} RETURNING id").fetchone()
            assert row is not None
            assert uses() == 1
            app.execute(f"{INSERT} ON CONFLICT DO NOTHING")
            psycopg.ClientCursor(app).execute(
                "INSERT INTO outbox_new (event_type, payload) SELECT 'e', '{}' "
                "FROM generate_series(1, 3)"
            )
            assert uses() == 3  # one tick per statement, not per row: its SELECT ran once
            assert app.execute("SELECT count(*) FROM outbox_new").fetchone() == (rows + 5,)
            marked = app.execute(
                "UPDATE outbox_new SET published_at = now() WHERE id = %s", row[:1]
            )
            assert marked.rowcount == 1
            # An UPDATE's tick is a one-time filter over its scan: once per partition scanned.
            assert uses() in (4, 5)


@pytest.mark.pg_edges
def test_the_drop_gate_refuses_when_it_cannot_read_the_counter(
    dsn: str, roles: DocumentedRoles
) -> None:
    """A counter it may not read is no evidence: the gate names the grant instead of passing
    (PostgreSQL 18 returns NULL for a sequence one may not read, older ones raise)."""
    with psycopg.connect(roles.owner_dsn, autocommit=True) as owner:
        create_flat_outbox(owner)
        run_through_base(owner, roles.owner_dsn, "copra")
        with Runner(roles.owner_dsn, settings(), "copra", include_optional=True) as runner:
            runner.run("original-name")
            assert runner.next().ran == ["copra.drop-view.count-view-writes"]
        owner.execute("REVOKE SELECT ON SEQUENCE outbox_new_view_uses FROM CURRENT_USER")
        with (
            Runner(
                roles.owner_dsn, settings(**FAST_GATE), "copra", include_optional=True
            ) as runner,
            pytest.raises(PreconditionFailed, match="cannot read the use counter"),
        ):
            runner.run("drop-view")
        assert relkinds(owner)["outbox_new"] == "v"
