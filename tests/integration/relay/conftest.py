"""Fixtures for relay tests: outbox tables on a fresh database and an in-memory sink.

`CollectSink` is a real sink (it stores what it is given, thread-safely), not a stand-in for
the database: every relay test runs claim, publish and mark against real PostgreSQL.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox, create_partitioned_outbox

from outbox_migrate.config import OutboxSpec
from outbox_migrate.relay.message import Message

SPEC = OutboxSpec()
PARTITIONED_START = 1_000_001


class CollectSink:
    """Keeps every published message in order; `fail` decides per batch whether to refuse."""

    name = "collect"

    def __init__(self, shared: Collected, fail: Callable[[Sequence[Message]], None] | None = None):
        self.shared = shared
        self.fail = fail

    def publish(self, batch: Sequence[Message]) -> None:
        if self.fail is not None:
            self.fail(batch)
        self.shared.add(batch)

    def close(self) -> None:
        return None


class Collected:
    """What every CollectSink of one relay received."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.messages: list[Message] = []
        self.batches = 0

    def add(self, batch: Sequence[Message]) -> None:
        with self.lock:
            self.messages.extend(batch)
            self.batches += 1

    @property
    def ids(self) -> list[int]:
        with self.lock:
            return [m.id for m in self.messages]

    def duplicates(self) -> int:
        return sum(c - 1 for c in Counter(self.ids).values())

    def factory(self, fail: Callable[[Sequence[Message]], None] | None = None):
        return lambda: CollectSink(self, fail)


@pytest.fixture
def collected() -> Collected:
    return Collected()


@pytest.fixture
def flat(conn: psycopg.Connection) -> psycopg.Connection:
    create_flat_outbox(conn, SPEC)
    return conn


@pytest.fixture
def partitioned(conn: psycopg.Connection) -> psycopg.Connection:
    create_partitioned_outbox(conn, SPEC, start=PARTITIONED_START)
    return conn


def ids_in(conn: psycopg.Connection, table: str, *, published: bool | None = None) -> list[int]:
    where = (
        ""
        if published is None
        else (" WHERE published_at IS NOT NULL" if published else " WHERE published_at IS NULL")
    )
    return [r[0] for r in conn.execute(f"SELECT id FROM {table}{where} ORDER BY id").fetchall()]


@pytest.fixture
def thread_errors() -> Iterator[list[BaseException]]:
    """Collect exceptions from helper threads so a test fails loudly on them."""
    errors: list[BaseException] = []
    yield errors
    assert not errors, errors


def swapped_outbox(conn: psycopg.Connection, published: list[int], unpublished: int) -> None:
    """After the swap: the old table is the DEFAULT partition and keeps its primary key,
    holding `published`; rows 1..`unpublished` wait in the unpublished partition."""
    conn.execute(
        "CREATE TABLE outbox_new (id bigint NOT NULL, event_type text, message_key text, "
        "payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now(), "
        "published_at timestamptz) PARTITION BY LIST (published_at)"
    )
    conn.execute("CREATE TABLE outbox_unpublished PARTITION OF outbox_new FOR VALUES IN (NULL)")
    conn.execute("CREATE INDEX ON outbox_unpublished (id)")
    conn.execute(
        "CREATE TABLE outbox (LIKE outbox_new INCLUDING DEFAULTS, CONSTRAINT outbox_pkey "
        "PRIMARY KEY (id))"
    )
    conn.execute(
        "INSERT INTO outbox (id, payload, published_at) SELECT unnest(%s::int8[]), '{}', now()",
        (published,),
    )
    conn.execute("ALTER TABLE outbox_new ATTACH PARTITION outbox DEFAULT")
    conn.execute(
        "INSERT INTO outbox_new (id, payload) SELECT i, jsonb_build_object('n', i) "
        "FROM generate_series(1, %s) i",
        (unpublished,),
    )
    conn.commit()
