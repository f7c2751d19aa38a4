"""One poison message among many, on a real broker: it reaches the dead-letter table after
`max_attempts` rejections while every other message is published (issue 16). The refusal and
the oversize message every sink must handle are test_contract.py's; here the cases particular
to one broker."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import insert_rows

from outbox_migrate.relay.sinks import SinkConfig
from outbox_migrate.relay.worker import Relay
from tests.integration.relay.conftest import SPEC, ids_in
from tests.integration.relay.sinks.test_brokers import relay_to

pytestmark = pytest.mark.newest_pg_only
COUNT = 100
FAST = {"backoff_base_s": 0.01, "backoff_cap_s": 0.05, "max_attempts": 2}


def assert_dead_lettered_alone(conn: psycopg.Connection, victim: int, error: str) -> None:
    rows = conn.execute("SELECT id, attempts, last_error FROM outbox_dead_letter").fetchall()
    assert [(r[0], r[1]) for r in rows] == [(victim, 2)], rows
    assert error in rows[0][2], rows[0][2]
    assert ids_in(conn, "outbox_unpublished") == []


def _nats_ids(nats_url: str, stream: str) -> list[int]:
    import nats

    async def read() -> list[int]:
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            info = await js.stream_info(stream)
            ids = []
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                ids.append(int((await js.get_msg(stream, seq)).headers["outbox-id"]))
            await js.delete_stream(stream)
            return ids
        finally:
            await nc.close()

    return asyncio.run(read())


@pytest.mark.broker("nats")
def test_nats_no_stream_for_the_subject_rejects_instead_of_retrying_for_ever(
    dsn: str, partitioned: psycopg.Connection, nats_url: str
) -> None:
    insert_rows(partitioned, "outbox_new", 5, spec=SPEC)
    subject = f"om.nostream.{uuid.uuid4().hex[:8]}"
    relay = relay_to(
        dsn, "nats",
        SinkConfig(url=nats_url, target=subject, extra={"create_stream": "false"}), **FAST,
    )  # fmt: skip
    assert relay.stats.dead_lettered == 5 and relay.stats.sink_failures == 0
    errors = partitioned.execute("SELECT DISTINCT last_error FROM outbox_dead_letter").fetchall()
    assert len(errors) == 1 and "NoStreamResponseError" in errors[0][0]


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[object]:
    import redis

    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.mark.broker("rabbitmq")
def test_rabbitmq_a_message_over_max_message_size_is_dead_lettered_not_an_outage(
    dsn: str, partitioned: psycopg.Connection, small_rabbitmq_url: str
) -> None:
    """A body over the broker's max_message_size closes the channel (406). The sink used to
    report that as "sink unavailable" for the whole batch and retry it for ever: one row
    stopped the outbox. The test's own node has a 64 KiB limit (conftest.small_rabbitmq_url)."""
    from tests.integration.relay.sinks.conftest import SMALL_RABBITMQ_MAX_MESSAGE_SIZE
    from tests.integration.relay.sinks.test_brokers import read_queue

    insert_rows(partitioned, "outbox_new", COUNT, spec=SPEC)
    victim = ids_in(partitioned, "outbox_new")[41]
    partitioned.execute(
        "UPDATE outbox_new SET payload = json_build_object('blob', repeat('x', %s)) WHERE id = %s",
        (SMALL_RABBITMQ_MAX_MESSAGE_SIZE + 1000, victim),
    )
    queue = f"om-too-large-{uuid.uuid4().hex[:8]}"
    config = SinkConfig(url=small_rabbitmq_url, target=queue)
    done: list[Relay] = []
    runner = threading.Thread(
        target=lambda: done.append(relay_to(dsn, "rabbitmq", config, batch_size=50, **FAST)),
        daemon=True,
    )
    runner.start()
    runner.join(timeout=60)  # the old sink retried the batch for ever: --until-empty never ends
    assert done, "the relay is still retrying the batch with the too-large message"
    relay = done[0]
    expected = [i for i in ids_in(partitioned, "outbox_new") if i != victim]
    received = sorted(i for i, _ in read_queue(small_rabbitmq_url, queue))
    assert sorted(set(received)) == expected
    # Messages of the victim's batch that the broker took but had not confirmed when it closed
    # the channel are sent again (at least once); none after the victim, none twice more.
    again = {i for i in received if received.count(i) > 1}
    assert all(i < victim and received.count(i) == 2 for i in again), again
    assert relay.stats.published == COUNT - 1
    assert relay.stats.sink_failures == 0  # not an outage: no backoff, no reconnect loop
    assert_dead_lettered_alone(partitioned, victim, "max_message_size 65536")


@pytest.mark.broker("redis")
def test_key_ordering_parks_only_the_rejected_messages_key(
    dsn: str, partitioned: psycopg.Connection, redis_url: str, redis_client
) -> None:
    """Keys A, B, C interleaved; B's third message is refused (WRONGTYPE on its stream). A and
    C flow at once; B's later messages are published only once the refused one is
    dead-lettered (same transaction or later), never before it. The old relay marked them in
    the batches right after the refusal, ahead of it."""
    from outbox_migrate.relay.options import Ordering, RelayOptions
    from outbox_migrate.relay.sinks import factory
    from outbox_migrate.relay.worker import Relay, running

    insert_rows(partitioned, "outbox_new", 90, spec=SPEC)
    partitioned.execute(
        "UPDATE outbox_new SET message_key = (ARRAY['A', 'B', 'C'])[1 + (id - 1) % 3]"
    )
    b_ids = [r[0] for r in partitioned.execute(
        "SELECT id FROM outbox_new WHERE message_key = 'B' ORDER BY id"
    ).fetchall()]  # fmt: skip
    victim = b_ids[2]
    partitioned.execute("UPDATE outbox_new SET event_type = 'poison' WHERE id = %s", (victim,))
    prefix = f"om-park-{uuid.uuid4().hex[:8]}"
    redis_client.set(f"{prefix}.poison", "not a stream")
    options = RelayOptions(
        ordering=Ordering.key, batch_size=10, listen=False, poll_interval_s=0.05,
        backoff_base_s=2.0, backoff_cap_s=2.0, max_attempts=2,
    )  # fmt: skip
    config = SinkConfig(url=redis_url, target=prefix + ".{event_type}")
    relay = Relay(dsn, factory("redis", config), spec=SPEC, options=options)
    try:
        with running(relay):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                left = partitioned.execute(
                    "SELECT count(*) FROM outbox_unpublished WHERE message_key <> 'B'"
                ).fetchone()
                if left == (0,):
                    break
                time.sleep(0.02)
            # A and C are all out; B waits behind its refused message (retry due in 1-2 s).
            waiting = ids_in(partitioned, "outbox_unpublished")
            assert waiting and set(waiting) <= set(b_ids), waiting
            assert victim in waiting
            deadline = time.monotonic() + 30
            while ids_in(partitioned, "outbox_unpublished") and time.monotonic() < deadline:
                time.sleep(0.05)
        stream = [int(f[b"id"]) for _, f in redis_client.xrange(f"{prefix}.event")]
    finally:
        redis_client.delete(f"{prefix}.poison", f"{prefix}.event")
    assert_dead_lettered_alone(partitioned, victim, "WRONGTYPE")
    dead_at = partitioned.execute("SELECT dead_at FROM outbox_dead_letter").fetchone()[0]
    later_b = partitioned.execute(
        "SELECT min(published_at) FROM outbox_published WHERE message_key = 'B' AND id > %s",
        (victim,),
    ).fetchone()[0]
    others = partitioned.execute(
        "SELECT max(published_at) FROM outbox_published WHERE message_key <> 'B'"
    ).fetchone()[0]
    assert later_b >= dead_at > others
    expected = [i for i in ids_in(partitioned, "outbox_new") if i != victim]
    assert sorted(set(stream)) == expected
