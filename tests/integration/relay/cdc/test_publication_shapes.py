"""What a publication sees of the relay's mark, per publication shape (docs/relay.md, "CDC
mode"): the reason `relay --mode cdc` publishes only the unpublished partition's inserts, and
the facts behind the advice to teams with their own CDC consumer on the outbox."""

from __future__ import annotations

import time

import psycopg
import pytest

from outbox_migrate.relay.cdc import pgoutput

SHAPES = {
    "parent_via_root": "FOR TABLE outbox_new WITH (publish_via_partition_root = true)",
    "parent_by_leaf": "FOR TABLE outbox_new WITH (publish_via_partition_root = false)",
    "unpublished_inserts": "FOR TABLE outbox_unpublished WITH (publish = 'insert')",
}


def _changes(conn: psycopg.Connection, name: str, want: int) -> list[tuple[str, str]]:
    """(kind, relation) of each row change the slot of publication `name` decodes, once at
    least `want` arrived (the test servers commit asynchronously: the WAL trails)."""
    deadline = time.monotonic() + 10
    relations: dict[int, str] = {}
    seen: list[tuple[str, str]] = []
    while time.monotonic() < deadline and len(seen) < want:
        rows = conn.execute(
            "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, "
            "'proto_version', '1', 'publication_names', %s)",
            (f"s_{name}", name),
        ).fetchall()
        seen = []
        for (data,) in rows:
            message = pgoutput.decode(data)
            if isinstance(message, pgoutput.Relation):
                relations[message.oid] = message.name
            elif isinstance(message, pgoutput.Insert):
                seen.append(("INSERT", relations[message.oid]))
            elif isinstance(message, pgoutput.Other) and message.kind in ("U", "D"):
                oid = int.from_bytes(bytes(data[1:5]), "big")
                seen.append((message.kind, relations.get(oid, "?")))
        time.sleep(0.1)
    return seen


@pytest.fixture
def shapes(cdc_outbox: psycopg.Connection) -> psycopg.Connection:
    conn = cdc_outbox
    for name, target in SHAPES.items():
        conn.execute(f"CREATE PUBLICATION {name} {target}")
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (f"s_{name}",))
    return conn


def test_a_mark_without_replica_identity_fails_under_an_update_publication(
    shapes: psycopg.Connection,
) -> None:
    shapes.execute("INSERT INTO outbox_new (payload) VALUES ('{}')")
    with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState):
        shapes.execute("UPDATE outbox_new SET published_at = now()")


def test_what_each_publication_sees_of_an_insert_and_its_mark(shapes: psycopg.Connection) -> None:
    for partition in ("outbox_unpublished", "outbox_published"):
        shapes.execute(f"ALTER TABLE {partition} REPLICA IDENTITY FULL")
    shapes.execute("INSERT INTO outbox_new (payload) VALUES ('{}')")
    shapes.execute("UPDATE outbox_new SET published_at = now()")  # the relay's mark
    # Via the root, the mark is a DELETE and a second INSERT of the parent: an insert-driven
    # consumer would publish the message again.
    assert _changes(shapes, "parent_via_root", 3) == [
        ("INSERT", "outbox_new"), ("D", "outbox_new"), ("INSERT", "outbox_new"),
    ]  # fmt: skip
    assert _changes(shapes, "parent_by_leaf", 3) == [
        ("INSERT", "outbox_unpublished"), ("D", "outbox_unpublished"),
        ("INSERT", "outbox_published"),
    ]  # fmt: skip
    # What `relay --mode cdc` publishes: the insert, and nothing of the mark (read after the
    # other two, so the mark's WAL has been decoded by then).
    assert _changes(shapes, "unpublished_inserts", 1) == [("INSERT", "outbox_unpublished")]
