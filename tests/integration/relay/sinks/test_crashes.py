"""Crash tests against a real broker (Redis Streams).

* The relay process is SIGKILLed after the broker acknowledged a batch and before the mark:
  after a restart every message is delivered, with at most that one batch duplicated.
* The broker goes down (killed, then restarted from its append-only file): the relay backs
  off without marking anything, recovers by itself, and loses nothing. The outage lasts
  30 s, as the issue asks; the backoff is capped at BACKOFF_CAP_S so the relay reaches its
  capped delays well within the outage and the test checks it retried at that pace, not
  faster (spinning) and not slower (given up).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import insert_rows
from outbox_migrate_harness.testing.server import free_port

from outbox_migrate.relay.options import RelayOptions
from outbox_migrate.relay.sinks import SinkConfig, factory
from outbox_migrate.relay.worker import Relay, running
from tests.integration.relay.conftest import SPEC, ids_in

from .conftest import client, unavailable, wait_port
from .crash_sink import KILL_AFTER_BATCHES

pytestmark = [pytest.mark.newest_pg_only, pytest.mark.broker("redis")]
REPO = Path(__file__).resolve().parents[4]
BATCH = 50
BROKER_DOWN_S = 30.0
BACKOFF_CAP_S = 2.0


def stream_ids(url: str, stream: str) -> list[int]:
    import redis

    conn = redis.Redis.from_url(url)
    try:
        return [int(fields[b"id"]) for _, fields in conn.xrange(stream)]
    finally:
        conn.close()


def test_sigkill_after_ack_before_mark_loses_nothing(
    dsn: str, partitioned: psycopg.Connection, redis_url: str
) -> None:
    insert_rows(partitioned, "outbox_new", 400, spec=SPEC)
    stream = f"om-crash-{uuid.uuid4().hex[:8]}"
    common = ["--dsn", dsn, "--sink-url", redis_url, "--target", stream,
              "--batch-size", str(BATCH), "--until-empty", "--ordering", "global"]  # fmt: skip
    crashed = subprocess.run(
        [sys.executable, "-m", "outbox_migrate", "relay", "--sink",
         "tests.integration.relay.sinks.crash_sink:KillAfterAck", *common],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    # Two batches were marked; the third reached Redis but not its mark.
    assert len(ids_in(partitioned, "outbox_published")) == (KILL_AFTER_BATCHES - 1) * BATCH
    assert len(stream_ids(redis_url, stream)) == KILL_AFTER_BATCHES * BATCH
    restarted = subprocess.run(
        [sys.executable, "-m", "outbox_migrate", "relay", "--sink", "redis", *common],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert restarted.returncode == 0, restarted.stderr
    received = stream_ids(redis_url, stream)
    duplicates = sum(c - 1 for c in Counter(received).values())
    assert set(received) == set(ids_in(partitioned, "outbox_new"))
    assert 0 < duplicates <= BATCH
    assert ids_in(partitioned, "outbox_unpublished") == []


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[tuple[str, callable, callable]]:
    """A private, durable Redis (AOF, fsync always) that the test may kill and restart."""
    client("redis", "redis")
    binary = shutil.which("redis-server")
    if binary is None:
        unavailable("redis-server is not installed")
    port = free_port()
    data = tmp_path / "redis"
    data.mkdir()
    command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "yes", "--appendfsync", "always", "--dir", str(data)]  # fmt: skip
    state: dict[str, subprocess.Popen] = {}

    def start() -> None:
        state["p"] = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert wait_port(port, 20), "private redis did not start"

    def kill() -> None:
        state["p"].kill()
        state["p"].wait()

    start()
    try:
        yield f"redis://127.0.0.1:{port}/0", kill, start
    finally:
        if state["p"].poll() is None:
            kill()


def test_broker_down_backs_off_recovers_and_loses_nothing(
    dsn: str, partitioned: psycopg.Connection, own_redis
) -> None:
    url, kill, start = own_redis
    stream = "om-outage"
    insert_rows(partitioned, "outbox_new", 300, spec=SPEC)
    relay = Relay(
        dsn, factory("redis", SinkConfig(url=url, target=stream, timeout_s=2.0)), spec=SPEC,
        options=RelayOptions(batch_size=BATCH, listen=False, poll_interval_s=0.05,
                             backoff_base_s=0.05, backoff_cap_s=BACKOFF_CAP_S),
    )  # fmt: skip
    with running(relay):
        deadline = time.monotonic() + 30
        while ids_in(partitioned, "outbox_unpublished") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ids_in(partitioned, "outbox_unpublished") == []
        kill()
        insert_rows(partitioned, "outbox_new", 300, spec=SPEC)
        time.sleep(BROKER_DOWN_S)
        # While the broker is down nothing is marked, and the relay is backing off, not spinning.
        assert len(ids_in(partitioned, "outbox_published")) == 300
        failures = relay.stats.sink_failures
        # Equal jitter: each capped delay is in [cap/2, cap], so at least ~BROKER_DOWN_S / cap
        # and at most 2 * BROKER_DOWN_S / cap retries (plus the short first delays).
        assert (
            BROKER_DOWN_S / BACKOFF_CAP_S - 2 <= failures <= 2 * BROKER_DOWN_S / BACKOFF_CAP_S + 10
        )
        start()
        deadline = time.monotonic() + 30
        while ids_in(partitioned, "outbox_unpublished") and time.monotonic() < deadline:
            time.sleep(0.05)
    assert ids_in(partitioned, "outbox_unpublished") == []
    received = stream_ids(url, stream)
    duplicates = sum(c - 1 for c in Counter(received).values())
    assert set(received) == set(ids_in(partitioned, "outbox_new"))
    assert duplicates <= BATCH


FROZEN_S = 6.0
FROZEN_TIMEOUT_S = 1.0
FROZEN_BACKOFF_CAP_S = 0.2


def test_a_frozen_redis_costs_one_sink_timeout_per_attempt_and_the_batch_in_flight(
    dsn: str, partitioned: psycopg.Connection, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis SIGSTOPped for 6 s while the relay drains (the kernel still accepts its
    connections and buffers what is written to them; on SIGCONT Redis runs it all). Each
    attempt during the freeze is one sink timeout (1 s) of silence, then
    `relay.sink_unavailable`: a fresh sink's first question (Redis' size limit) unanswered is
    the outage, before any XADD is written. Only the batch in flight when Redis froze is
    added twice (one worker: the documented one batch per worker per fault). Fails before:
    the unanswered CONFIG GET was passed over and the attempt went on to connect — two
    timeouts of silence per attempt (20 s with the default 10-s timeout)."""
    import redis

    client("redis", "redis")
    binary = shutil.which("redis-server")
    if binary is None:
        unavailable("redis-server is not installed")
    port = free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    stream = "om-frozen"
    caplog.set_level("WARNING", logger="outbox_migrate.relay")
    try:
        assert wait_port(port, 20), "private redis did not start"
        url = f"redis://127.0.0.1:{port}/0"
        insert_rows(partitioned, "outbox_new", 20 * BATCH, spec=SPEC)
        sink = factory("redis", SinkConfig(url=url, target=stream, timeout_s=FROZEN_TIMEOUT_S))
        relay = Relay(
            dsn, sink, spec=SPEC,
            options=RelayOptions(batch_size=BATCH, listen=False, poll_interval_s=0.05,
                                 backoff_base_s=0.05, backoff_cap_s=FROZEN_BACKOFF_CAP_S,
                                 sink_timeout_s=FROZEN_TIMEOUT_S, read_ahead=False),
        )  # fmt: skip
        reader = redis.Redis.from_url(url)
        with running(relay):
            deadline = time.monotonic() + 20
            while reader.xlen(stream) < 2 * BATCH and time.monotonic() < deadline:
                time.sleep(0.005)
            process.send_signal(signal.SIGSTOP)
            frozen_at = time.time()
            time.sleep(FROZEN_S)
            process.send_signal(signal.SIGCONT)
            deadline = time.monotonic() + 30
            while ids_in(partitioned, "outbox_unpublished") and time.monotonic() < deadline:
                time.sleep(0.05)
        entries = [int(f[b"id"]) for _, f in reader.xrange(stream)]
        reader.close()
    finally:
        process.send_signal(signal.SIGCONT)
        process.terminate()
        process.wait(10)
    assert sorted(set(entries)) == ids_in(partitioned, "outbox_new")
    said = [r.created for r in caplog.records if r.getMessage().startswith("relay.sink_unavail")]
    said = [t for t in said if t <= frozen_at + FROZEN_S]
    gaps = [round(b - a, 2) for a, b in zip([frozen_at, *said], said, strict=False)]
    # The first attempt was in flight when Redis froze; each later one is one timeout long.
    assert len(gaps) >= 4 and max(gaps[1:]) < FROZEN_TIMEOUT_S + FROZEN_BACKOFF_CAP_S + 0.4, gaps
    assert len(entries) - len(set(entries)) <= BATCH
