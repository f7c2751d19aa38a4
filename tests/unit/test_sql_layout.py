"""`plan --format sql` laid out to the terminal: lines broken at clause boundaries, never
inside a token; what SQL sees is unchanged (psql runs the laid-out plan in
tests/e2e/test_plan_sql_with_psql.py)."""

from __future__ import annotations

import re

from outbox_migrate.sql_layout import layout

LONG_RAISE = (
    "        RAISE EXCEPTION 'outbox-migrate: precondition of hoper.v2.create-partitioned-table "
    "[relation-exists:outbox] failed: %', violation;"
)
GLUED_RAISE = (
    "        RAISE EXCEPTION 'outbox-migrate: precondition of hop.v3.gate-old-table-retired "
    "[no-new-ticks-since-sample:customer_order_events_outbox] failed: %', violation;"
)
"""Its second constant fits the width by itself, but not with the comma glued to it."""
LONG_SELECT = (
    'SELECT c.oid::regclass, "odd name" FROM pg_class c JOIN pg_namespace n ON n.oid = '
    "c.relnamespace WHERE c.relname = 'outbox' AND n.nspname = 'public' AND c.relkind <> 'p';"
)


def _words(sql_text: str) -> list[str]:
    """The SQL's tokens outside whitespace, with continued string constants joined."""
    joined = re.sub(r"'\s*\n\s*'", "", sql_text)
    return joined.split()


def test_every_line_fits_and_nothing_but_whitespace_changes() -> None:
    for line in (LONG_RAISE, GLUED_RAISE, LONG_SELECT):
        laid = layout(line, 80)
        assert max(len(piece) for piece in laid.splitlines()) <= 80, laid
        assert _words(laid) == _words(line)


def test_breaks_before_clauses_not_inside_operators_or_quoted_names() -> None:
    laid = layout(LONG_SELECT, 60).splitlines()
    assert any(piece.lstrip().startswith(("WHERE", "JOIN", "AND", "FROM")) for piece in laid)
    assert all(piece.count('"') % 2 == 0 for piece in laid)
    assert "::regclass" in laid[0]
    assert not any(piece.rstrip().endswith(("<", ":")) for piece in laid)


def test_a_long_constant_continues_as_adjacent_constants() -> None:
    laid = layout(LONG_RAISE, 80).splitlines()
    assert len(laid) > 1
    constants = re.findall(r"'((?:[^']|'')*)'", "\n".join(laid))
    assert "".join(constants) == re.findall(r"'((?:[^']|'')*)'", LONG_RAISE)[0]


def test_comments_wrap_as_comments_and_short_lines_stay() -> None:
    comment = "-- " + " ".join(["word"] * 40)
    laid = layout(comment, 80).splitlines()
    assert all(piece.startswith("--") and len(piece) <= 80 for piece in laid)
    assert layout("SELECT 1;", 80) == "SELECT 1;"
    meta = "\\set ON_ERROR_STOP 1 " + "x" * 100
    assert layout(meta, 80) == meta


def test_code_keeps_its_trailing_comment_below_it() -> None:
    line = "    FOR violation IN -- " + " ".join(["note"] * 25)
    laid = layout(line, 80).splitlines()
    assert laid[0] == "    FOR violation IN"
    assert all(piece.lstrip().startswith("--") for piece in laid[1:])


def test_a_functions_body_is_left_as_postgresql_stores_it() -> None:
    """The body was re-flowed like any SQL (`--   its` comments, a split PERFORM): the stored
    function then differed from the one `run` and Alembic create. A DO block is not stored:
    it is laid out as before."""
    body = (
        "BEGIN\n"
        "    -- an idle relay holds this lock exclusively: only then is a NOTIFY worth its "
        "commit-time cost\n"
        '    PERFORM pg_notify(TG_ARGV[0], (SELECT min("id")::text FROM "new_rows" WHERE '
        '"id" > 0));\n'
        "    RETURN NULL;\n"
        "END\n"
    )
    function = (
        'CREATE OR REPLACE FUNCTION "public"."outbox_new_relay_notify"() RETURNS trigger '
        "LANGUAGE plpgsql AS $om$\n" + body + "$om$;"
    )
    laid = layout(function + "\nDO $om_assert$\n" + body + "$om_assert$;", 80)
    assert body + "$om$;" in laid
    assert max(len(line) for line in laid.split("$om$;")[1].splitlines()) <= 80
    assert max(len(line) for line in laid.split("$om$\n")[0].splitlines()) <= 80
