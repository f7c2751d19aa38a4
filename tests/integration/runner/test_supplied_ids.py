"""Ids the application supplies: the new table accepts them at every phase, and the deploy
gates see a writer that supplies its own ids.

Two outboxes: a bigserial table whose application sometimes supplies the id (database ids),
and a bigint table with no generator at all whose application makes every id, as
DotNetCore.CAP's snowflake ids (`id_kind = application`). The writers run as the
application's role, which has no privilege on anything the migration creates.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outbox_migrate.config import load_settings
from outbox_migrate.errors import PreconditionFailed
from outbox_migrate.patterns import PATTERN_NAMES
from outbox_migrate.patterns.model import Pattern, Step, Table
from outbox_migrate.runner import Runner
from outbox_migrate.runner.events import SilentEvents
from tests.support.app import publish_all

SNOWFLAKE = 2_100_000_000_000_000_000
"""Where the application's own ids start: a snowflake id of today is about this large."""
OUTBOXES = {
    "serial": (
        "CREATE TABLE outbox (id bigserial PRIMARY KEY, event_type text NOT NULL DEFAULT "
        "'event', payload json NOT NULL, created_at timestamptz NOT NULL DEFAULT now(), "
        "published_at timestamptz)",
        {},
    ),
    "application": (
        "CREATE TABLE outbox (id bigint PRIMARY KEY, event_type text NOT NULL DEFAULT "
        "'event', payload json NOT NULL, created_at timestamptz NOT NULL DEFAULT now(), "
        "published_at timestamptz)",
        # the primary key is the only thing keeping application ids unique: plan says so,
        # and here the application keeps them unique itself
        {"id_kind": "application", "accept_lost_unique": ["outbox_pkey"]},
    ),
}
GATE_TRIES = 10


def settings(names: dict[str, Any], **extra: Any) -> Any:
    return load_settings(
        {"gate_window_s": 0.1, "lock_budget_s": 10.0, **names, **extra}, environ={}
    )


def app_role(conn: psycopg.Connection[Any]) -> str:
    """The application's role: INSERT and SELECT on the outbox (and its sequence), nothing
    else. Roles are cluster-wide: one per test."""
    role = f"om_app_{uuid.uuid4().hex[:8]}"
    conn.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(role)))
    conn.execute(sql.SQL("GRANT SELECT, INSERT ON outbox TO {}").format(sql.Identifier(role)))
    conn.execute(
        sql.SQL("GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO {}").format(sql.Identifier(role))
    )
    return role


def insert_supplied(conn: psycopg.Connection[Any], table: str, ident: int,
                    published: bool = False) -> None:  # fmt: skip
    conn.execute(
        sql.SQL(
            "INSERT INTO {} (id, payload, published_at) VALUES (%s, '{{}}', "
            "CASE WHEN %s THEN now() END)"
        ).format(sql.Identifier(table)),
        (ident, published),
    )


class OldWriter:
    """A V1 instance that keeps inserting rows with its own ids into the old table (as the
    application's role). Its rows are published at once, as a fast V1 relay would: the
    table stays drained, so only the writer gate can see it."""

    def __init__(self, dsn: str, role: str) -> None:
        self.dsn, self.role = dsn, role
        self.stop = threading.Event()
        self.written = 0
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(self.role)))
            ident = SNOWFLAKE + 10**9
            while not self.stop.is_set():
                ident += 4096
                try:
                    insert_supplied(conn, "outbox", ident, published=True)
                    self.written += 1
                except psycopg.Error as exc:
                    self.errors.append(str(exc).splitlines()[0])
                time.sleep(0.005)

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


@pytest.mark.pg_edges
@pytest.mark.parametrize("kind", sorted(OUTBOXES))
def test_an_old_writer_supplying_its_ids_keeps_the_v3_gate_shut(kind: str, dsn: str) -> None:
    """A V1 instance inserting rows with its own ids (published at once, so the old table
    stays drained) during `run --to V3`: the gate refuses every time, 10 of 10, and passes
    once that instance is gone. A gate watching the id's sequence saw nothing move."""
    ddl, names = OUTBOXES[kind]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(ddl)
        role = app_role(conn)
        for i in range(5):
            insert_supplied(conn, "outbox", SNOWFLAKE + i, published=True)
        with Runner(dsn, settings(names), "hop") as runner:
            runner.run("V2")
        writer = OldWriter(dsn, role)
        try:
            refusals = []
            for _ in range(GATE_TRIES):
                with (
                    Runner(dsn, settings(names), "hop") as runner,
                    pytest.raises(PreconditionFailed) as refused,
                ):
                    runner.run("V3")
                refusals.append(refused.value.observed)
        finally:
            writer.finish()
        assert writer.errors == [] and writer.written > GATE_TRIES
        assert all(
            "still receiving inserts" in why or "open transaction" in why for why in refusals
        ), refusals
        publish_all(conn, "outbox")
        with Runner(dsn, settings(names), "hop") as runner:
            assert runner.run("V3").phase == "V3"


class SuppliedIdChecker(SilentEvents):
    """After every step: the outgoing version's INSERT with a supplied id works on the table
    it inserts into; after a phase's last step, the incoming version's too. In a transaction
    rolled back, as the application's role."""

    def __init__(self, dsn: str, pattern: Pattern, role: str) -> None:
        self.dsn, self.pattern, self.role = dsn, pattern, role
        self.checked: list[str] = []
        self.next_id = SNOWFLAKE + 10**12

    def step_finished(self, step: Step, outcome: str, elapsed_s: float) -> None:
        phases = self.pattern.phases
        index = self.pattern.phase_names().index(step.phase)
        self._insert(phases[index - 1])
        if step is phases[index].steps[-1]:
            self._insert(phases[index])
        self.checked.append(step.id)

    def _insert(self, phase: Any) -> None:
        renamed = phase.app.renamed
        table = "outbox" if phase.app.inserts_into is Table.OLD or renamed else "outbox_new"
        self.next_id += 1
        with psycopg.connect(self.dsn) as conn:
            conn.execute("SET lock_timeout = '5s'")
            conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(self.role)))
            insert_supplied(conn, table, self.next_id)
            conn.rollback()


@pytest.mark.pg_edges  # partitions share the parent's identity from PostgreSQL 17 on
@pytest.mark.parametrize("name", PATTERN_NAMES)
@pytest.mark.parametrize("kind", sorted(OUTBOXES))
def test_an_insert_that_supplies_its_id_works_at_every_phase(
    kind: str, name: str, dsn: str
) -> None:
    """V2's new table takes a supplied id (BY DEFAULT, or no identity for application ids),
    through the swap and under the original name too; ids the database generates on the new
    table never meet ids the application drew from the old sequence."""
    ddl, names = OUTBOXES[kind]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(ddl)
        role = app_role(conn)
        for i in range(20):
            insert_supplied(conn, "outbox", SNOWFLAKE + i, published=i < 15)
        if kind == "serial":
            conn.execute("INSERT INTO outbox (payload) SELECT '{}' FROM generate_series(1, 5)")
    probe = Runner(dsn, settings(names), name, include_optional=True)
    pattern = probe.pattern
    checker = SuppliedIdChecker(dsn, pattern, role)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for index, phase in enumerate(pattern.phases[1:], start=1):
            if pattern.phases[index - 1].app.publishes_from in (Table.OLD, Table.OLD_THEN_NEW):
                publish_all(conn, "outbox")
            with Runner(dsn, settings(names), name, include_optional=True,
                        events=checker) as runner:  # fmt: skip
                runner.run(phase.name)
            if kind == "serial" and phase.app.inserts_into is Table.NEW and not phase.app.renamed:
                # the application draws ids from the old sequence, the new table makes its own
                conn.execute(
                    "INSERT INTO outbox_new (id, payload) "
                    "SELECT nextval('outbox_id_seq'), '{}' FROM generate_series(1, 3)"
                )
                conn.execute("INSERT INTO outbox_new (payload) VALUES ('{}'), ('{}')")
        assert checker.checked == [s.id for s in pattern.steps()]
        final = "outbox" if pattern.phases[-1].app.renamed else "outbox_new"
        row = conn.execute(
            sql.SQL("SELECT count(*), count(DISTINCT id) FROM {}").format(sql.Identifier(final))
        ).fetchone()
        assert row is not None and row[0] == row[1]
