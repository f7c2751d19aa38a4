"""The unique key a mark broke, read from the error's fields, never from its words
(relay/mark_repair.py): the server names the index in every language, while the detail that
names the row is English only and names the first row alone. Against a real server: the key
of a primary key and of a unique index on the id is found, a key on two columns, a partial
index or a CHECK gives none (the repair bisects), and the ids a table holds already are found
all at once, for integer and uuid ids."""

from __future__ import annotations

import uuid

import psycopg
import pytest

from outbox_migrate.relay import mark_repair


def _violation(conn: psycopg.Connection, statement: str) -> psycopg.Error:
    with pytest.raises(psycopg.Error) as failed, conn.transaction():
        conn.execute(statement)
    return failed.value


def test_a_primary_key_on_the_id_is_found_and_names_every_taken_id(
    conn: psycopg.Connection,
) -> None:
    conn.execute("CREATE TABLE published (id bigint PRIMARY KEY, v int)")
    conn.execute("INSERT INTO published SELECT g, g FROM generate_series(1, 10) g")
    error = _violation(conn, "INSERT INTO published VALUES (3, 0), (7, 0)")
    key = mark_repair.of_error(conn, error, "id")
    assert key is not None
    assert (key.schema, key.table, key.index, key.column) == (
        "public", "published", "published_pkey", "id",
    )  # fmt: skip
    assert key.taken(conn, [3, 7, 11, 12], text_ids=False) == {3, 7}
    assert "published_pkey" in key.reason(3) and "23505" in key.reason(3)
    assert mark_repair.of_error(conn, error, "v") is None  # not the outbox's id column


def test_a_unique_index_on_a_uuid_id_finds_taken_ids_as_text(conn: psycopg.Connection) -> None:
    taken = uuid.uuid4()
    conn.execute("CREATE TABLE published (message_id uuid NOT NULL, v int)")
    conn.execute("CREATE UNIQUE INDEX published_message_id ON published (message_id)")
    conn.execute("INSERT INTO published VALUES (%s, 1)", (taken,))
    error = _violation(conn, f"INSERT INTO published VALUES ('{taken}', 2)")
    key = mark_repair.of_error(conn, error, "message_id")
    assert key is not None and key.type_sql == "uuid"
    assert key.taken(conn, [str(taken), str(uuid.uuid4())], text_ids=True) == {str(taken)}


@pytest.mark.parametrize(
    ("ddl", "bad_insert"),
    [
        ("CREATE TABLE published (id bigint, n int, UNIQUE (id, n))",
         "INSERT INTO published VALUES (1, 1), (1, 1)"),
        ("CREATE TABLE published (id bigint, n int);"
         "CREATE UNIQUE INDEX ON published (id) WHERE n > 0",
         "INSERT INTO published VALUES (1, 1), (1, 1)"),
        ("CREATE TABLE published (id bigint, n int CHECK (n > 0))",
         "INSERT INTO published VALUES (1, 0)"),
    ],
    ids=["two-columns", "partial", "check"],
)  # fmt: skip
def test_other_constraints_have_no_key(conn: psycopg.Connection, ddl: str, bad_insert: str) -> None:
    conn.execute(ddl)
    error = _violation(conn, bad_insert)
    assert mark_repair.of_error(conn, error, "id") is None
