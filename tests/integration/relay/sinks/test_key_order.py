"""`--ordering key` keeps each key's first deliveries in id order through a refusal, on real
brokers and the in-process sink.

A message of key B is refused twice (a transient refusal: the sink acknowledges the rest of
its batch, as a broker refusing one record does) while the application keeps writing A, B and
C. B parks, its later messages are held back below the relay's cursor, and newer B messages
keep arriving above it. Before the fix, once the refused message went through, the newer ones
went out at once and the held-back ones only with the next rescan about a second later: B's
first deliveries came out of id order. The broker's own record is read back: Redis stream
entries in XADD order (first occurrence of each id), the JetStream stream in sequence order
(it drops re-sent ids itself), the in-process sink's list.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence

import psycopg
import pytest

from outbox_migrate.errors import MessagesRejected
from outbox_migrate.relay.message import Message
from outbox_migrate.relay.options import Ordering, RelayOptions
from outbox_migrate.relay.sinks import SinkConfig, factory
from outbox_migrate.relay.worker import Relay, running
from tests.integration.relay.conftest import SPEC, Collected, ids_in

pytestmark = pytest.mark.newest_pg_only
KEYS = ("A", "B", "C")
WRITE_S = 4.0
"""How long the application writes while B is parked and released."""
WRITE_EVERY_S = 0.01
REFUSALS = 2
BACKOFF_S = 0.3
"""The relay's backoff (base = cap): the refused message is due again 0.15 to 0.3 s later,
well inside the writing period, so B is released while newer B messages keep arriving."""


class RefusingSink:
    """Refuses the `victim` the first REFUSALS times it is in a batch, with the later messages
    of its key in that batch (a producer that keeps per-key order stops a key at its first
    failure; what reaches the broker out of order is then the relay's doing alone). Every
    other message goes to the real sink first: a refusal means "the rest were acknowledged"."""

    name = "refusing"

    def __init__(self, inner: object, victim: list[int], refused: list[int]) -> None:
        self.inner = inner
        self.victim = victim
        self.refused = refused

    def publish(self, batch: Sequence[Message]) -> None:
        victim = next((m for m in batch if self.victim and m.id == self.victim[0]), None)
        if victim is None or len(self.refused) >= REFUSALS:
            self.inner.publish(batch)  # type: ignore[attr-defined]
            return
        stopped = {m.id for m in batch if m.key == victim.key and m.id >= victim.id}
        rest = [m for m in batch if m.id not in stopped]
        if rest:
            self.inner.publish(rest)  # type: ignore[attr-defined]
        self.refused.append(victim.id)
        raise MessagesRejected(self.name, dict.fromkeys(stopped, "refused for the test"))

    def close(self) -> None:
        self.inner.close()  # type: ignore[attr-defined]


def order_violations(first_deliveries: Sequence[tuple[int, str]]) -> list[tuple[str, int, int]]:
    """(key, earlier id, later id) for every message first delivered after a higher id of its
    key had been first delivered."""
    seen: set[int] = set()
    highest: dict[str, int] = {}
    bad: list[tuple[str, int, int]] = []
    for outbox_id, key in first_deliveries:
        if outbox_id in seen:
            continue
        seen.add(outbox_id)
        top = highest.get(key)
        if top is not None and outbox_id < top:
            bad.append((key, outbox_id, top))
        highest[key] = max(outbox_id, top or outbox_id)
    return bad


def _write(dsn: str, stop: threading.Event, victim: list[int]) -> None:
    """The application: one row every WRITE_EVERY_S, keys A, B, C in turn; B's third row is
    the victim. Its id is recorded before its transaction commits: recorded after, a relay
    that claims the row at once could publish it before the sink knows it is the victim."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        n = 0
        while not stop.is_set():
            key = KEYS[n % len(KEYS)]
            with conn.transaction():
                row = conn.execute(
                    "INSERT INTO outbox_new (event_type, message_key, payload) "
                    "VALUES ('event', %s, '{}') RETURNING id",
                    (key,),
                ).fetchone()
                assert row is not None
                if key == "B" and n // len(KEYS) == 2:
                    victim.append(row[0])
            n += 1
            time.sleep(WRITE_EVERY_S)


def _redis_reader(url: str) -> tuple[Callable[[], object], Callable[[], list[int]]]:
    import redis

    stream = f"om-order-{uuid.uuid4().hex[:8]}"

    def read() -> list[int]:
        client = redis.Redis.from_url(url)
        try:
            return [int(fields[b"id"]) for _, fields in client.xrange(stream)]
        finally:
            client.delete(stream)
            client.close()

    return factory("redis", SinkConfig(url=url, target=stream)), read


def _nats_reader(url: str) -> tuple[Callable[[], object], Callable[[], list[int]]]:
    import nats

    subject = f"om.order.{uuid.uuid4().hex[:8]}"
    stream = subject.replace(".", "_").upper()

    async def read_async() -> list[int]:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            info = await js.stream_info(stream)
            ids = []
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                ids.append(int((await js.get_msg(stream, seq)).headers["Nats-Msg-Id"]))
            await js.delete_stream(stream)
            return ids
        finally:
            await nc.close()

    return factory("nats", SinkConfig(url=url, target=subject)), lambda: asyncio.run(read_async())


@pytest.fixture
def broker(
    request: pytest.FixtureRequest,
) -> Iterator[tuple[Callable[[], object], Callable[[], list[int]]]]:
    kind = request.param
    if kind == "collect":
        collected = Collected()
        yield collected.factory(), lambda: collected.ids
    elif kind == "redis":
        yield _redis_reader(request.getfixturevalue("redis_url"))
    else:
        yield _nats_reader(request.getfixturevalue("nats_url"))


@pytest.mark.parametrize(
    "broker",
    [
        "collect",
        pytest.param("redis", marks=pytest.mark.broker("redis")),
        pytest.param("nats", marks=pytest.mark.broker("nats")),
    ],
    indirect=True,
)
def test_a_released_key_keeps_its_first_deliveries_in_id_order(
    dsn: str,
    partitioned: psycopg.Connection,
    broker: tuple[Callable[[], object], Callable[[], list[int]]],
) -> None:
    build, read = broker
    victim: list[int] = []
    refused: list[int] = []
    options = RelayOptions(
        ordering=Ordering.key, batch_size=10, listen=False, poll_interval_s=0.05,
        backoff_base_s=BACKOFF_S, backoff_cap_s=BACKOFF_S, max_attempts=REFUSALS + 3,
    )  # fmt: skip
    relay = Relay(dsn, lambda: RefusingSink(build(), victim, refused), spec=SPEC, options=options)
    stop = threading.Event()
    writer = threading.Thread(target=_write, args=(dsn, stop, victim), daemon=True)
    with running(relay):
        writer.start()
        time.sleep(WRITE_S)
        stop.set()
        writer.join(10)
        deadline = time.monotonic() + 30
        while ids_in(partitioned, "outbox_unpublished") and time.monotonic() < deadline:
            time.sleep(0.05)
    assert ids_in(partitioned, "outbox_unpublished") == []
    assert refused == [victim[0]] * REFUSALS  # B really was parked, twice
    keys = dict(partitioned.execute("SELECT id, message_key FROM outbox_new").fetchall())
    delivered = read()
    assert set(delivered) == set(keys)
    assert order_violations([(i, keys[i]) for i in delivered]) == []


SPACING_BACKOFF_S = 0.2
"""Backoff base = cap: each next attempt of the poison is due 0.1 to 0.2 s after the last."""


def test_a_parked_messages_attempts_follow_the_backoff_not_the_rescan(
    dsn: str, partitioned: psycopg.Connection
) -> None:
    """A poison that every attempt refuses, under `--ordering key`, with notifications on and
    the default 1-s poll interval: its attempts are spaced by the backoff (0.1 to 0.2 s here),
    and it is dead-lettered at the fifth. Fails before the fix: a parked message was only
    claimed again by the key-shard rescan from id 0 (every second at best, deferred by 100
    times its own duration), so the attempts were 1 s or more apart."""
    attempts: list[float] = []
    collected = Collected()

    def refuse_poison(batch: Sequence[Message]) -> None:
        poison = [m.id for m in batch if m.event_type == "poison"]
        if poison:
            attempts.append(time.monotonic())
            collected.add([m for m in batch if m.id not in poison])
            raise MessagesRejected("collect", dict.fromkeys(poison, "poison"))

    partitioned.execute(
        "INSERT INTO outbox_new (event_type, message_key, payload) "
        "SELECT CASE WHEN g = 5 THEN 'poison' ELSE 'event' END, 'k' || (g % 3), '{}' "
        "FROM generate_series(1, 30) g"
    )
    options = RelayOptions(
        ordering=Ordering.key, batch_size=10, max_attempts=5,
        backoff_base_s=SPACING_BACKOFF_S, backoff_cap_s=SPACING_BACKOFF_S,
    )  # fmt: skip
    relay = Relay(dsn, collected.factory(refuse_poison), spec=SPEC, options=options)
    with running(relay):
        deadline = time.monotonic() + 20
        while ids_in(partitioned, "outbox_unpublished") and time.monotonic() < deadline:
            time.sleep(0.02)
    assert ids_in(partitioned, "outbox_unpublished") == []
    assert len(attempts) == 5
    spacing = [round(b - a, 3) for a, b in itertools.pairwise(attempts)]
    # Never before the backoff's lower bound, and not much after its upper bound (a claim).
    assert all(SPACING_BACKOFF_S / 2 <= gap < SPACING_BACKOFF_S + 0.35 for gap in spacing), spacing
    (dead,) = partitioned.execute("SELECT id FROM outbox_dead_letter").fetchall()
    assert len(set(collected.ids)) == 29 and dead[0] not in collected.ids
