"""The rename phases in any order an operator can type, as the roles the docs name: the runner
as the table's (non-superuser) owner, the application as a role with INSERT only.

- `original-name` after a migration run to its end *without* --with-optional: the optional
  steps it passed by (SET NOT NULL, which needs the CHECK `drop-check` removed) stay passed by;
  HOPIA's optional drop of its detached partition runs then, as the rename needs its name.
- The rename rolled back while the version of the original name writes: every row it commits
  is in the partitioned table (0 stranded) — its inserts into the old table fail loudly: a
  DEFAULT partition refuses unpublished rows (HOPER, HOPIA), HOP's retired table is sealed.
- A row in a table no relay reads fails `verify`, and the rename refuses to move it aside.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox, insert_rows
from psycopg import sql

from outbox_migrate.config import OutboxSpec, load_settings
from outbox_migrate.errors import PreconditionFailed, VerifyFailed
from outbox_migrate.relay.options import Mode, RelayOptions
from outbox_migrate.relay.worker import Relay, running
from outbox_migrate.runner import Runner
from outbox_migrate.runner import inspect as read_only
from tests.integration.relay.conftest import Collected
from tests.support.app import act_as, count, publish_all
from tests.support.roles import DocumentedRoles

FAST = {"gate_window_s": 0.2, "lock_budget_s": 10.0}
NEXT_VERSION = OutboxSpec(table="outbox_retired", partitioned_table="outbox")
"""How the version of the original name configures its relay (docs/relay.md)."""


def settings(**extra: Any) -> Any:
    return load_settings({**FAST, **extra}, environ={})


def unpublished(conn: psycopg.Connection, table: str) -> int:
    row = conn.execute(
        sql.SQL("SELECT count(*) FROM {} WHERE published_at IS NULL").format(sql.Identifier(table))
    ).fetchone()
    assert row is not None
    return int(row[0])


def run_without_optional(owner: psycopg.Connection, app: psycopg.Connection, name: str) -> int:
    """Every required phase, as docs/runner.md and every `Next:` line show it (no
    --with-optional), the application writing and publishing as each version does."""
    dsn = owner.info.dsn
    written = 0
    pattern = Runner(dsn, settings(), name).pattern
    for index, phase in enumerate(pattern.phases[1:], start=1):
        if pattern.phases[index - 1].app.publishes_from.value in ("old", "old-then-new"):
            publish_all(app, "outbox")
        with Runner(dsn, settings(), name) as runner:
            assert runner.run(phase.name).phase == phase.name
        act_as(app, phase)
        written += 7
    assert read_only.status(dsn, settings())["state"] == "completed"
    return written


def relay_of(dsn: str, collected: Collected, spec: OutboxSpec, **options: Any) -> Relay:
    return Relay(
        dsn,
        collected.factory(),
        spec=spec,
        options=RelayOptions(mode=Mode.partitioned, listen=False, poll_interval_s=0.05, **options),
    )


@pytest.mark.parametrize("name", ["hoper", "hopia"])
def test_original_name_after_a_migration_run_without_optional(
    name: str, dsn: str, roles: DocumentedRoles
) -> None:
    """Under live load: the previous version writing (through the view once renamed) and
    publishing, then the version of the original name. Before: "original-name before V4: run
    --to V4 first" on a completed migration, then exit 5 (`set-not-null` needs the CHECK
    `drop-check` removed)."""
    collected = Collected()
    with (
        psycopg.connect(roles.owner_dsn, autocommit=True) as owner,
        psycopg.connect(roles.app_dsn, autocommit=True) as app,
    ):
        prepared(owner, roles.app)
        written = 50 + run_without_optional(owner, app, name)
        publish_all(app, "outbox")

        previous = relay_of(roles.app_dsn, collected, OutboxSpec())
        with running(previous), Writer(roles.app_dsn, "outbox_new") as writer:
            time.sleep(0.3)
            with Runner(roles.owner_dsn, settings(), name, include_optional=True) as runner:
                ran = runner.run("original-name").ran
            time.sleep(0.3)
        assert f"{name}.v4.set-not-null" not in ran
        assert ran[-1] == f"{name}.original-name.take-original-name"
        assert not writer.errors and writer.committed > 0
        written += writer.committed

        following = relay_of(roles.app_dsn, collected, NEXT_VERSION)
        with running(following), Writer(roles.app_dsn, "outbox") as writer:
            time.sleep(0.3)
            with Runner(roles.owner_dsn, settings(), name, include_optional=True) as runner:
                assert runner.run("drop-view").completed
                assert runner.verify() == []
            time.sleep(0.3)
        assert not writer.errors and writer.committed > 0
        written += writer.committed
        drain = relay_of(roles.app_dsn, collected, NEXT_VERSION, until_empty=True)
        drain.run()

        assert count(owner, "outbox") == written
        assert unpublished(owner, "outbox") == 0
        ids = {int(r[0]) for r in owner.execute("SELECT id FROM outbox")}
        assert ids >= set(collected.ids)
        assert read_only.verify(roles.owner_dsn, settings(), include_optional=True) == ("drop-view")


class Writer:
    """One application version: inserts into `table` back to back, one row per transaction,
    as the application's role; counts what committed and what failed."""

    def __init__(self, dsn: str, table: str = "outbox") -> None:
        self.dsn = dsn
        self.table = table
        self.committed = 0
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self.stop.is_set():
                try:
                    insert_rows(conn, self.table, 1)
                    self.committed += 1
                except psycopg.Error as exc:
                    self.errors.append(str(exc).splitlines()[0])
                time.sleep(0.002)

    def __enter__(self) -> Writer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


def prepared(owner: psycopg.Connection, app_role: str) -> None:
    create_flat_outbox(owner)
    owner.execute(
        sql.SQL("GRANT SELECT, INSERT, UPDATE ON outbox TO {}").format(sql.Identifier(app_role))
    )
    insert_rows(owner, "outbox", 50, published=True)


@pytest.mark.parametrize("name", ["hop", "hoper", "hopia"])
def test_rename_rolled_back_under_the_original_names_writer_strands_nothing(
    name: str, dsn: str, roles: DocumentedRoles
) -> None:
    """Before (HOP): exit 0, and the writer's rows landed in the flat table no relay reads
    (`verify` passed, and taking the name again moved them aside unpublished)."""
    with (
        psycopg.connect(roles.owner_dsn, autocommit=True) as owner,
        psycopg.connect(roles.app_dsn, autocommit=True) as app,
    ):
        prepared(owner, roles.app)
        run_without_optional(owner, app, name)
        last_base = Runner(roles.owner_dsn, settings(), name).pattern.phases[-1].name
        with Runner(roles.owner_dsn, settings(), name, include_optional=True) as runner:
            runner.run("original-name")
        before = count(owner, "outbox")
        with Writer(roles.app_dsn) as writer:
            time.sleep(0.3)
            with Runner(roles.owner_dsn, settings(), name) as runner:
                runner.rollback(last_base)
            time.sleep(0.5)
        # Every row the writer committed is in the partitioned table, under its name again.
        assert count(owner, "outbox_new") == before + writer.committed
        assert unpublished(owner, "outbox") == 0
        assert writer.errors, "the writer of the original name must fail loudly"
        assert read_only.verify(roles.owner_dsn, settings()) == last_base


@pytest.mark.newest_pg_only
def test_a_row_no_relay_reads_fails_verify_and_is_never_moved_aside(
    dsn: str, roles: DocumentedRoles
) -> None:
    """HOP after V3: a V1 instance that came back inserts into the flat table, which no relay
    reads any more. Before: `verify` passed, and `original-name` moved the row, unpublished,
    into outbox_retired."""
    with (
        psycopg.connect(roles.owner_dsn, autocommit=True) as owner,
        psycopg.connect(roles.app_dsn, autocommit=True) as app,
    ):
        prepared(owner, roles.app)
        run_without_optional(owner, app, "hop")
        insert_rows(app, "outbox", 1)  # the stray V1 row
        with pytest.raises(VerifyFailed, match=r"1 unpublished row\(s\) in outbox.*no relay reads"):
            read_only.verify(roles.owner_dsn, settings())
        with (
            Runner(roles.owner_dsn, settings(), "hop", include_optional=True) as runner,
            pytest.raises(PreconditionFailed, match="no-unread-rows"),
        ):
            runner.run("original-name")
        assert unpublished(owner, "outbox") == 1  # still where a flat relay finds it
        publish_all(app, "outbox")
        assert read_only.verify(roles.owner_dsn, settings()) == "V3"
        with Runner(roles.owner_dsn, settings(), "hop", include_optional=True) as runner:
            runner.run("original-name")
