"""A refused command writes nothing: every refusal the operator regressions exercise leaves
the ledger byte-for-byte as it was (each ledger table's rows as text, before and after).

The runner decides a whole command before it writes (plan → validate → apply). Before that,
a refused `copy-back --no-drop` marked earlier steps done on its way to refusing, and at the
end of HOPER's V2 it ran and recorded V3's gate.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox, insert_rows
from psycopg import sql

from outbox_migrate.config import OutboxSpec
from tests.integration.runner.test_operator_regressions import ENV, om
from tests.support.app import publish_all
from tests.support.roles import DocumentedRoles

Conn = psycopg.Connection[tuple[object, ...]]
PUBLISH = ("publish",)
"""Setup marker: V1's relay publishes every row of the old table (the V3 gate can pass)."""
COPY_BACK = ("copy-back", "--no-drop", "--batch-size", "100", "--no-adaptive")


@pytest.fixture
def operator(dsn: str, monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> Iterator[Conn]:
    for key in [k for k in os.environ if k.startswith("OUTBOX_MIGRATE_") and "TEST" not in k]:
        monkeypatch.delenv(key)
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(str(tmp_path))
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        insert_rows(conn, "outbox", 30, published=True)
        yield conn


def ledger_snapshot(conn: Conn) -> dict[str, list[str]]:
    """Every row of every ledger table, as text, in a stable order ({}: no ledger)."""
    tables = [
        str(r[0])
        for r in conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'outbox_migrate' ORDER BY 1"
        )
    ]
    return {
        table: [
            str(r[0])
            for r in conn.execute(
                sql.SQL("SELECT t::text FROM {} t ORDER BY 1").format(
                    sql.Identifier("outbox_migrate", table)
                )
            )
        ]
        for table in tables
    }


def hoper(*argv: str) -> tuple[str, ...]:
    return (argv[0], "--pattern", "hoper", *argv[1:])


REFUSALS: dict[str, tuple[list[tuple[str, ...]], tuple[str, ...], tuple[int, ...]]] = {
    # name: (setup commands, the refused command, its exit codes)
    "copy-back-before-anything": ([], COPY_BACK, (2, 5)),
    "copy-back-inside-v2": ([hoper("next")] * 4, COPY_BACK, (2,)),
    "copy-back-at-the-end-of-v2": ([hoper("run", "--to", "V2")], COPY_BACK, (2,)),
    "copy-back-after-drop-identity": (
        [PUBLISH, hoper("run", "--to", "V2"), hoper("run", "--to", "V3"), hoper("next")],
        COPY_BACK,
        (2,),
    ),
    "copy-back-on-hopia": ([("run", "--pattern", "hopia", "--to", "V2")], COPY_BACK, (2, 5)),
    "another-pattern-active": (
        [hoper("run", "--to", "V2")],
        ("run", "--pattern", "hop", "--to", "V2"),
        (2,),
    ),
    "next-of-another-pattern": ([hoper("run", "--to", "V2")], ("next", "--pattern", "hop"), (2,)),
    "to-two-deploys-ahead": ([], hoper("run", "--to", "V3"), (2,)),
    "to-ahead-after-v2": ([hoper("run", "--to", "V2")], hoper("run", "--to", "V4"), (2,)),
    "to-behind": (
        [PUBLISH, hoper("run", "--to", "V2"), hoper("run", "--to", "V3")],
        hoper("run", "--to", "V2"),
        (2,),
    ),
    "rollback-ahead": ([hoper("run", "--to", "V2")], hoper("rollback", "--to", "V3"), (2,)),
    "reset-another-pattern-forced": (
        [hoper("run", "--to", "V2")],
        ("reset", "--pattern", "cop", "--yes", "--force"),
        (2,),
    ),
    "reset-while-applied": ([hoper("run", "--to", "V2")], hoper("reset", "--yes"), (5,)),
    "second-pattern-after-completed-hop": (
        [("run", "--pattern", "hop", "--to", "V2"), PUBLISH, ("next", "--pattern", "hop")],
        hoper("run", "--to", "V2"),
        (2,),
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_a_refused_command_leaves_the_ledger_unchanged(dsn: str, operator: Conn, name: str) -> None:
    setup, refused, codes = REFUSALS[name]
    for argv in setup:
        if argv == PUBLISH:
            publish_all(operator, "outbox")
            continue
        result = om(dsn, *argv)
        assert result.code == 0, (argv, result)
    before = ledger_snapshot(operator)
    result = om(dsn, *refused)
    assert result.code in codes, result
    assert len(result.stderr.strip().splitlines()) == 1, result  # one actionable line
    assert ledger_snapshot(operator) == before


def test_reset_force_cannot_hand_a_swapped_migration_to_another_pattern(
    dsn: str, operator: Conn
) -> None:
    """`reset --pattern cop --force` abandoned an active HOPER migration; `run --pattern hop
    --to V2` then skipped plan's "already a partition" blocker, adopted HOPER's objects,
    failed at create-published-partition and left `hop|active|V1`. Now the reset of another
    pattern is refused, and after a deliberate reset of HOPER itself `run` gets exactly
    `plan`'s admission check: refused, nothing written."""
    publish_all(operator, "outbox")
    for phase in ("V2", "V3", "V4"):
        assert om(dsn, *hoper("run", "--to", phase)).code == 0
    refused = om(dsn, "reset", "--pattern", "cop", "--yes", "--force")
    assert refused.code == 2, refused
    assert "reset --pattern hoper" in refused.stderr, refused
    states = operator.execute("SELECT pattern, state FROM outbox_migrate.migration").fetchall()
    assert states == [("hoper", "active")]
    assert om(dsn, *hoper("reset", "--yes", "--force")).code == 0
    before = ledger_snapshot(operator)
    result = om(dsn, "run", "--pattern", "hop", "--to", "V2")
    assert result.code == 2, result
    assert "already" in result.stderr and "partition" in result.stderr, result
    assert ledger_snapshot(operator) == before
    plan = om(dsn, "plan", "--pattern", "hop")
    assert plan.code == 2, plan  # the same blocker `plan` reports


@pytest.fixture
def as_owner(roles: DocumentedRoles, monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> str:
    """The CLI's environment, and the default outbox created by a non-superuser owner, who
    runs the commands (its DSN is returned)."""
    for key in [k for k in os.environ if k.startswith("OUTBOX_MIGRATE_") and "TEST" not in k]:
        monkeypatch.delenv(key)
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(str(tmp_path))
    with psycopg.connect(roles.owner_dsn, autocommit=True) as owner:
        create_flat_outbox(owner)
        insert_rows(owner, "outbox", 30, published=True)
    return roles.owner_dsn


def test_a_name_another_tables_migration_owns_is_a_blocker(as_owner: str, dsn: str) -> None:
    """QA #4: COPRA of `outbox` created `outbox_new`; HOPER of a second table with the default
    names failed its first step's precondition (exit 5) and left a second `active` migration
    in the ledger, its hint "reset the ledger". The clash is known before anything is written:
    `plan` and `run` report it as a blocker (exit 2) naming `--partitioned-table`, and the
    ledger stays as it was."""
    assert om(as_owner, "run", "--pattern", "copra", "--to", "V2").code == 0
    with psycopg.connect(as_owner, autocommit=True) as owner:
        create_flat_outbox(owner, OutboxSpec(table="uuid_outbox"))
        before = ledger_snapshot(owner)
        for command in ("plan", "run"):
            argv = [command, "--pattern", "hoper", "--table", "uuid_outbox"]
            result = om(as_owner, *argv, *(["--to", "V2"] if command == "run" else []))
            assert result.code == 2, result
            line = result.stderr.strip().splitlines()[-1]
            assert len(result.stderr.strip().splitlines()) == 1, result
            assert '"public"."outbox_new"' in line or "public.outbox_new" in line, line
            assert "--partitioned-table" in line and "public.outbox" in line, line
            assert "reset" not in line, line
            assert ledger_snapshot(owner) == before


def test_a_step_refused_at_its_turn_leaves_no_migration_behind(as_owner: str) -> None:
    """A run whose very first step is refused at run time (a precondition only the step
    checks: here a table by hand under the partitioned table's name) applied nothing, so it
    leaves no migration record either: a second one, `active` and "completed through V1",
    was what QA #4 found. The hint names `--partitioned-table`, not a ledger reset."""
    with psycopg.connect(as_owner, autocommit=True) as owner:
        owner.execute("CREATE TABLE outbox_new (note text)")
        result = om(as_owner, "run", "--pattern", "hoper", "--to", "V2")
        assert result.code == 5, result
        line = result.stderr.strip().splitlines()[-1]
        assert "relation-absent:outbox_new" in line and "--partitioned-table" in line, line
        assert "reset the ledger" not in line, line
        assert owner.execute("SELECT count(*) FROM outbox_migrate.migration").fetchone() == (0,)
        assert owner.execute("SELECT count(*) FROM outbox_migrate.step").fetchone() == (0,)
        # A next run starts afresh once the name is free.
        owner.execute("DROP TABLE outbox_new")
    assert om(as_owner, "run", "--pattern", "hoper", "--to", "V2").code == 0
