"""Command sequences the operator fuzzer (test_operator_fuzzer.py) found to break a promise,
replayed deterministically through the CLI, one test per finding.

Each docstring gives the sequence the fuzzer printed; the test is the smallest sequence that
still shows it. A finding the runner does not handle yet is marked `xfail(strict=True)`, so
the fix turns it into an unexpected pass that asks for the marker to go.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox, insert_rows

from tests.support.app import publish_all
from tests.support.operator_fuzz import CliResult, cli

ENV = {
    "OUTBOX_MIGRATE_GATE_WINDOW_S": "0.1",
    "OUTBOX_MIGRATE_LOCK_TIMEOUT_MS": "50",
    "OUTBOX_MIGRATE_LOCK_BUDGET_S": "2",
}


@pytest.fixture
def operator(
    dsn: str, monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> Iterator[tuple[str, psycopg.Connection[tuple[object, ...]]]]:
    """A flat outbox with published and unpublished rows, and the CLI's environment."""
    for key in [k for k in os.environ if k.startswith("OUTBOX_MIGRATE_") and "TEST" not in k]:
        monkeypatch.delenv(key)
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(str(tmp_path))
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        insert_rows(conn, "outbox", 30, published=True)
        yield dsn, conn


def om(dsn: str, *argv: str) -> CliResult:
    result = cli(*argv, "--dsn", dsn)
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr, result
    return result


def phase_of(dsn: str, pattern: str) -> str:
    result = om(dsn, "status", "--pattern", pattern, "--format", "json")
    assert result.code == 0, result
    return str(json.loads(result.stdout)["phase"])


def test_rollback_to_a_phase_ahead_is_refused(
    operator: tuple[str, psycopg.Connection[tuple[object, ...]]],
) -> None:
    """Fuzzer: `next`, `next` (HOPER, inside V2), then `rollback --to V3` -> 0, no output.

    Here: at the end of V2, `rollback --to V3` must be refused as out of order (exit 2) and
    leave the ledger where it was."""
    dsn, _ = operator
    assert om(dsn, "run", "--pattern", "hoper", "--to", "V2").code == 0
    result = om(dsn, "rollback", "--pattern", "hoper", "--to", "V3")
    assert result.code == 2, result
    assert phase_of(dsn, "hoper") == "V2"


def pending_steps(dsn: str, pattern: str) -> tuple[str, list[str]]:
    result = om(dsn, "status", "--pattern", pattern, "--format", "json")
    assert result.code == 0, result
    document = json.loads(result.stdout)
    pending = [s["id"] for s in document["steps"] if s["state"] not in ("done", "adopted")]
    return str(document["state"]), pending


def test_hoper_after_a_completed_hop_is_refused(
    operator: tuple[str, psycopg.Connection[tuple[object, ...]]],
) -> None:
    """Fuzzer (HOP, V2 deployed): `run --to V2`, `next` (the V3 gate: HOP completed), then
    `run --pattern hoper --to V2` -> 0 "done": HOPER adopted HOP's live partitions."""
    dsn, _ = operator
    assert om(dsn, "run", "--pattern", "hop", "--to", "V2").code == 0
    assert om(dsn, "next", "--pattern", "hop").code == 0
    assert om(dsn, "next", "--pattern", "hop").code == 0  # V3's gate, then its cleanup
    assert pending_steps(dsn, "hop") == ("completed", [])
    result = om(dsn, "run", "--pattern", "hoper", "--to", "V2")
    assert result.code == 2, result
    assert pending_steps(dsn, "hoper")[0] == "not started"


def test_second_pattern_on_a_completed_migration_is_refused(
    operator: tuple[str, psycopg.Connection[tuple[object, ...]]],
) -> None:
    """Fuzzer: a HOP migration recorded completed, then `run --pattern hoper --to V2` -> 0.
    Here the issue's form of it: HOPER completed, then `run -p hop --to V2` must be refused,
    and `rollback -p hop --to V1` must not drop anything (the relay needs every partition)."""
    dsn, conn = operator
    for phase in ("V2", "V3", "V4", "copy-back"):
        result = om(dsn, "run", "--pattern", "hoper", "--to", phase)
        assert result.code == 0, result
    assert pending_steps(dsn, "hoper")[0] == "completed"
    tables = {r[0] for r in conn.execute("SELECT relname FROM pg_class WHERE relkind IN ('r','p')")}
    result = om(dsn, "run", "--pattern", "hop", "--to", "V2")
    assert result.code != 0, result
    om(dsn, "rollback", "--pattern", "hop", "--to", "V1")
    after = {r[0] for r in conn.execute("SELECT relname FROM pg_class WHERE relkind IN ('r','p')")}
    assert tables <= after, sorted(tables - after)


def test_refused_rollback_leaves_a_truthful_ledger(
    operator: tuple[str, psycopg.Connection[tuple[object, ...]]],
) -> None:
    """Fuzzer (HOP): V2 deployed and publishing, `next` (V3 gate, completed), `rollback --to
    V1` -> 5 (outbox_published holds rows). The gate and the tuning had been reversed before
    the refusal; status still said `completed`, so nothing ever ran the gate again.

    A refused rollback either touched nothing, or the ledger says how far it went."""
    dsn, conn = operator
    assert om(dsn, "run", "--pattern", "hop", "--to", "V2").code == 0
    insert_rows(conn, "outbox_new", 5)
    publish_all(conn, "outbox_new")  # V2's relay: the rows move to outbox_published
    assert om(dsn, "run", "--pattern", "hop", "--to", "V3").code == 0
    assert pending_steps(dsn, "hop") == ("completed", [])
    result = om(dsn, "rollback", "--pattern", "hop", "--to", "V1")
    assert result.code == 5, result
    state, pending = pending_steps(dsn, "hop")
    assert not (state == "completed" and pending), (state, pending)


@pytest.mark.parametrize("pattern", ["hoper", "hopia"])
def test_verify_between_steps_of_a_phase(
    pattern: str, operator: tuple[str, psycopg.Connection[tuple[object, ...]]]
) -> None:
    """Fuzzer (HOPIA, each deploy done in order): `next` step by step through V4; right after
    `swap-default`, `verify` -> 1 "invariants of phase V3 do not hold: outbox_published is
    not attached to outbox_new DEFAULT (found: not a partition)". `next` may stop anywhere,
    so verify must hold after every step it ran."""
    dsn, _ = operator
    for phase in ("V2", "V3"):
        assert om(dsn, "run", "--pattern", pattern, "--to", phase).code == 0
    for _ in range(10):
        result = om(dsn, "next", "--pattern", pattern)
        assert result.code == 0, result
        verified = om(dsn, "verify", "--pattern", pattern)
        assert verified.code == 0, (result.stderr, verified.stderr)
        if (
            dict((s["id"].split(".")[-1], s["state"]) for s in steps(dsn, pattern)).get(
                "swap-default"
            )
            == "done"
        ):
            break
    else:
        raise AssertionError("swap-default never ran")


def steps(dsn: str, pattern: str) -> list[dict[str, str]]:
    result = om(dsn, "status", "--pattern", pattern, "--format", "json")
    return list(json.loads(result.stdout)["steps"])


def test_copy_back_on_another_patterns_migration_is_a_refusal(
    operator: tuple[str, psycopg.Connection[tuple[object, ...]]],
) -> None:
    """Fuzzer (a HOPIA migration inside V2): `copy-back` -> 1 "public.outbox_published is
    still a partition: copy-back runs after HOPER's V4 swap has detached it". Nothing ran: it
    is the same mistake as `copy-back` on HOPER before V2 (-> 2). docs/cli.md: 1 is for an
    operation that ran and failed, 2 for a step out of order, 5 for a precondition."""
    dsn, conn = operator
    assert om(dsn, "run", "--pattern", "hopia", "--to", "V2").code == 0
    result = om(dsn, "copy-back", "--batch-size", "100", "--no-adaptive")
    assert result.code in (2, 5), result
    assert conn.execute("SELECT to_regclass('outbox_published') IS NOT NULL").fetchone() == (True,)


def test_refused_rollback_does_not_strand_hopia(
    operator: tuple[str, psycopg.Connection[tuple[object, ...]]],
) -> None:
    """Fuzzer (HOPIA, V2 deployed and publishing): `rollback --to V1` -> 5 at
    create-published-partition (outbox_published holds rows) — after it had already reversed
    install-copy-trigger. Then `run --to V2` -> 5 for ever: install-copy-trigger needs an
    empty outbox_published, which V2's relay keeps filling. No way forward, none back, and
    meanwhile published rows are no longer copied into the old table.

    A refused rollback must leave a way forward: `run --to V2` again succeeds and the trigger
    is in place."""
    dsn, conn = operator
    assert om(dsn, "run", "--pattern", "hopia", "--to", "V2").code == 0
    insert_rows(conn, "outbox_new", 5)
    publish_all(conn, "outbox_new")  # V2's relay: the rows move to outbox_published
    assert om(dsn, "rollback", "--pattern", "hopia", "--to", "V1").code == 5
    result = om(dsn, "run", "--pattern", "hopia", "--to", "V2")
    assert result.code == 0, result
    triggers = conn.execute(
        "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'outbox_published'::regclass "
        "AND NOT tgisinternal"
    ).fetchone()
    assert triggers == (1,)


def test_copy_back_inside_v2_keeps_the_published_partition(
    operator: tuple[str, psycopg.Connection[tuple[object, ...]]],
) -> None:
    """Fuzzer (HOPER, V1 app still writing): `next` x4 (V2's tables and index), `copy-back
    --no-drop` -> 5 at the V3 gate, `run --to V2` -> 0, `verify` -> 1 "outbox_published is not
    attached to outbox_new DEFAULT" — the published partition is gone, V2's ledger says done,
    and swap-default then refuses for ever (the playbook cannot finish)."""
    dsn, conn = operator
    insert_rows(conn, "outbox", 3)  # unpublished: the V3 gate refuses, as under a V1 writer
    for _ in range(4):
        assert om(dsn, "next", "--pattern", "hoper").code == 0
    refused = om(dsn, "copy-back", "--no-drop", "--batch-size", "100", "--no-adaptive")
    assert refused.code == 2, refused  # out of order: V2 is not even complete
    assert om(dsn, "run", "--pattern", "hoper", "--to", "V2").code == 0
    assert conn.execute("SELECT to_regclass('outbox_published') IS NOT NULL").fetchone() == (True,)
    result = om(dsn, "verify", "--pattern", "hoper")
    assert result.code == 0, result


def test_reset_is_refused_while_steps_are_applied(
    operator: tuple[str, psycopg.Connection[tuple[object, ...]]],
) -> None:
    """Fuzzer (COPRA): `run --to V2`, deploy V2, `next`, `next` (the V3 gate, then
    drop-identity), `reset --yes` -> 0. The record that knew how to give the old table its
    identity back was gone: V1's inserts failed (no id default) and every later `run` was
    refused. Now reset refuses while steps are applied; `rollback --to V1` undoes them, then
    the record can go, and the migration can start again."""
    dsn, conn = operator
    assert om(dsn, "run", "--pattern", "copra", "--to", "V2").code == 0
    publish_all(conn, "outbox")  # the old table drained: the V3 gate lets V3 begin
    assert om(dsn, "next", "--pattern", "copra").code == 0  # gate-old-table-retired
    assert om(dsn, "next", "--pattern", "copra").code == 0  # drop-identity
    refused = om(dsn, "reset", "--pattern", "copra", "--yes")
    assert refused.code == 5, refused
    assert "copra.v3.drop-identity" in refused.stderr and "rollback" in refused.stderr
    assert om(dsn, "rollback", "--pattern", "copra", "--to", "V1").code == 0
    assert om(dsn, "reset", "--pattern", "copra", "--yes").code == 0
    identity = conn.execute(
        "SELECT attidentity FROM pg_attribute WHERE attrelid = 'outbox'::regclass "
        "AND attname = 'id'"
    ).fetchone()
    assert identity is not None and identity[0] in ("a", "d")
    conn.execute("INSERT INTO outbox (payload) VALUES ('{}')")  # V1 can insert again
    assert om(dsn, "run", "--pattern", "copra", "--to", "V2").code == 0


def test_reset_force_abandons_an_applied_migration(
    operator: tuple[str, psycopg.Connection[tuple[object, ...]]],
) -> None:
    """`--force` keeps the escape hatch: the record goes, the schema stays as it is."""
    dsn, conn = operator
    assert om(dsn, "run", "--pattern", "hop", "--to", "V2").code == 0
    assert om(dsn, "reset", "--pattern", "hop", "--yes", "--force").code == 0
    state = conn.execute("SELECT state FROM outbox_migrate.migration").fetchone()
    assert state == ("abandoned",)
    assert conn.execute("SELECT to_regclass('outbox_new') IS NOT NULL").fetchone() == (True,)


def test_copy_back_does_not_adopt_steps_whose_undoer_merely_finds_nothing(
    operator: tuple[str, psycopg.Connection[tuple[object, ...]]],
) -> None:
    """Fuzzer (HOPER): V2 and V3 done, `next` (drop-identity), then `copy-back --no-drop`
    -> 2 "needs hoper.v4.swap-default first" — but on its way it had marked
    add-not-valid-check and validate-check done: their undoer, drop-check, counted as applied
    because its postcondition (the CHECK is absent) held, which it does just as well before the
    CHECK was ever added. The ledger then said done for a CHECK that never existed and every
    `run --to V4` failed at swap-default's "check-exists" precondition (the playbook could not
    finish)."""
    dsn, conn = operator
    publish_all(conn, "outbox")
    assert om(dsn, "run", "--pattern", "hoper", "--to", "V2").code == 0
    assert om(dsn, "run", "--pattern", "hoper", "--to", "V3").code == 0
    assert om(dsn, "next", "--pattern", "hoper").code == 0  # drop-identity
    refused = om(dsn, "copy-back", "--no-drop", "--batch-size", "100", "--no-adaptive")
    assert refused.code == 2, refused  # out of order: V4 is not done
    assert "add-not-valid-check" in refused.stderr, refused
    check = conn.execute(
        "SELECT count(*) FROM pg_constraint WHERE conname = 'outbox_published_check'"
    ).fetchone()
    assert check == (0,)  # the refusal changed nothing
    result = om(dsn, "run", "--pattern", "hoper", "--to", "V4")
    assert result.code == 0, result


def test_next_inside_a_phase_reports_the_boundary_it_reached(
    operator: tuple[str, psycopg.Connection[tuple[object, ...]]],
) -> None:
    """QA: HOPER done through V3, `next` applied `hoper.v4.drop-identity` and then said
    "stopped at the end of V3" and "deploy application version V3 …, then run --to V4",
    although V3 was deployed (V4's steps had begun) and the migration was part-way into V4.
    `next` and `run` end with what to do where they actually stopped: inside V4, finish V4's
    steps — no deploy first."""
    dsn, conn = operator
    publish_all(conn, "outbox")
    for phase in ("V2", "V3"):
        assert om(dsn, "run", "--pattern", "hoper", "--to", phase).code == 0
    text = om(dsn, "next", "--pattern", "hoper")
    assert text.code == 0, text
    assert "hoper.v4.drop-identity" in text.stderr, text
    assert "end of V3" not in text.stdout and "deploy" not in text.stdout, text.stdout
    assert "inside V4" in text.stdout, text.stdout
    assert "outbox-migrate run --pattern hoper --to V4" in text.stdout, text.stdout
    as_json = om(dsn, "next", "--pattern", "hoper", "--format", "json")
    result = json.loads(as_json.stdout.strip().splitlines()[-1])
    assert result["ran"] == ["hoper.v4.add-not-valid-check"], result
    assert (result["phase"], result["inside"]) == ("V3", "V4"), result
    assert "deploy" not in result["next"] and "--to V4" in result["next"], result
    # Its last step done, the phase's own boundary is reported again.
    assert om(dsn, "run", "--pattern", "hoper", "--to", "V4").code == 0
    document = json.loads(om(dsn, "status", "--pattern", "hoper", "--format", "json").stdout)
    assert document["phase"] == "V4", document
