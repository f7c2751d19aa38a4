"""A slow broker must not keep a migration step from its lock.

Every batch is one transaction, and it stays open while the broker acknowledges: with a broker
that takes 200 ms per batch and four workers, some worker holds the unpublished partition's
row locks nearly all the time. The step that needs the outbox's ACCESS EXCLUSIVE lock (HOPER's
swap-default) must still find a moment within its default lock budget (60 s) — in practice
within seconds, because no worker ever *waits* (linger, idle sleep, backoff) inside its
transaction: between two batches each session is outside any transaction for a moment.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import psycopg

from outbox_migrate.config import load_settings
from outbox_migrate.relay.message import Message
from outbox_migrate.relay.options import RelayOptions
from outbox_migrate.relay.worker import Relay, running
from outbox_migrate.runner import Runner
from tests.integration.runner.test_lock_safety import Writer, prepare_hoper_v3

from .conftest import SPEC, Collected

ACK_S = 0.2
"""How long the slow broker takes to acknowledge a batch."""
LOCK_FOUND_BOUND_S = 10.0
"""Well inside the default 60-s lock budget (measured here: 2.5 ms of lock wait, the relay
holding the parent only between its mark and COMMIT; its claims lock the partition alone)."""


def test_a_slow_broker_leaves_room_for_a_migration_steps_lock(
    dsn: str, collected: Collected
) -> None:
    prepare_hoper_v3(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:  # a backlog: every worker busy at once
        conn.execute(
            "INSERT INTO outbox_new (payload) SELECT json_build_object('n', g) "
            "FROM generate_series(1, 400) g"
        )

    def slow_ack(batch: Sequence[Message]) -> None:
        time.sleep(ACK_S)

    relay = Relay(
        dsn,
        collected.factory(slow_ack),
        spec=SPEC,
        options=RelayOptions(workers=4, batch_size=10, poll_interval_s=0.2),
    )
    writer = Writer(dsn)
    settings = load_settings({"gate_window_s": 0.1}, environ={})
    assert settings.lock_budget_s == 60.0  # the default budget is what is measured against
    with running(relay):
        deadline = time.monotonic() + 10
        while collected.batches < 8 and time.monotonic() < deadline:
            time.sleep(0.02)
        writer.start()
        before = collected.batches
        started = time.monotonic()
        try:
            with Runner(dsn, settings, "hoper") as runner:
                result = runner.run("V4")
            elapsed = time.monotonic() - started
            with psycopg.connect(dsn, autocommit=True) as conn:
                backlog = conn.execute("SELECT count(*) FROM outbox_unpublished").fetchone()
            deadline = time.monotonic() + 10
            while collected.batches < before + 8 and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            writer.stop.set()
            writer.join(10)
        during = collected.batches - before
    assert result.phase == "V4"
    # The workers had work throughout (a backlog left when the step was done) and kept
    # publishing, four at 200 ms a batch, after it.
    assert backlog is not None and backlog[0] > 0, backlog
    assert during >= 8, during
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT state, lock_wait_ms FROM outbox_migrate.step "
            "WHERE step_id = 'hoper.v4.swap-default'"
        ).fetchone()
    assert row is not None and row[0] == "done", row
    assert row[1] <= LOCK_FOUND_BOUND_S * 1000, row
    assert elapsed <= LOCK_FOUND_BOUND_S + 20, elapsed  # the whole V4 run, steps included
    assert writer.errors == []


def test_a_slow_webhook_never_outlasts_the_claim_session(
    dsn: str, partitioned: psycopg.Connection
) -> None:
    """A webhook answering each POST after 0.15 s, one at a time (global ordering), batches of
    40 (6 s each), a 1-s sink timeout and a 3-s session timeout (the claim session's
    idle-in-transaction timeout). Each publish ends at the sink timeout with what the webhook
    acknowledged; the relay marks those and claims the rest again: the session is never lost
    and no message the sink saw acknowledged is sent again. Fails before: the HTTP sink gave each request
    the whole timeout, the publish took 6 s, the server ended the session at 3 s and the
    batch went out again (connection retries, duplicates)."""
    from collections import Counter

    from outbox_migrate_harness.testing.schema import insert_rows

    from outbox_migrate.relay.options import Ordering
    from outbox_migrate.relay.sinks import SinkConfig, factory
    from tests.support.webhook import Webhook

    from .conftest import ids_in

    insert_rows(partitioned, "outbox_new", 40, spec=SPEC)
    options = RelayOptions(
        ordering=Ordering.global_, batch_size=40, listen=False, poll_interval_s=0.05,
        sink_timeout_s=1.0, session_timeout_s=3.0,
    )  # fmt: skip
    with Webhook(lambda body: (204, 0.15)) as hook:
        config = SinkConfig(url=hook.url, timeout_s=1.0, ordering=Ordering.global_)
        relay = Relay(dsn, factory("http", config), spec=SPEC, options=options)
        with running(relay):
            deadline = time.monotonic() + 30
            while ids_in(partitioned, "outbox_unpublished") and time.monotonic() < deadline:
                time.sleep(0.05)
        accepted = Counter(hook.accepted)
    assert ids_in(partitioned, "outbox_unpublished") == []
    assert relay.stats.connection_retries == 0
    assert relay.stats.sink_failures >= 4  # the publish really ran out of time, batch by batch
    # Sent twice: only the request the deadline cut (answered after the sink gave up on it),
    # one per publish that ran out of time.
    twice = [i for i, n in accepted.items() if n > 1]
    assert len(twice) <= relay.stats.sink_failures and max(accepted.values()) <= 2, accepted
    assert sorted(accepted) == ids_in(partitioned, "outbox_new")
