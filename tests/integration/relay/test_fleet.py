"""Fleet behaviour on one machine (loopback): the faults that need no network namespace.

* a relay process paused with SIGSTOP keeps a live TCP connection, so keepalives never fire;
  its shards must still move within the session timeout (idle-in-transaction / idle-session
  timeouts end its session) — before, they stayed with the paused process for good;
* a relay that reaches PostgreSQL but not its broker steps out of the fleet, so the others
  serve its shards — before, it kept them through its backoff, forever;
* `/readyz` says "holds shards or is a live standby"; the shard gauge counts the shards;
* the worker sessions really carry the server-side timeouts.

The network faults (link down, silent packet loss, broker unreachable by route) are in
tests/netns.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import insert_rows

from outbox_migrate.errors import SinkUnavailable
from outbox_migrate.relay import keepalive
from outbox_migrate.relay.driver import REAP_MARGIN_S
from outbox_migrate.relay.message import Message
from outbox_migrate.relay.metrics import Observer
from outbox_migrate.relay.options import RelayOptions
from outbox_migrate.relay.worker import Relay, running

from .conftest import SPEC, Collected, ids_in

pytestmark = pytest.mark.pg_edges  # timers and locks the fleet relies on exist on 14 and up

SESSION_TIMEOUT_S = 4.0


def _relay_process(dsn: str, out: Path, *extra: str) -> subprocess.Popen[bytes]:
    with out.open("wb") as stdout, out.with_suffix(".log").open("wb") as stderr:
        return subprocess.Popen(
            [sys.executable, "-m", "outbox_migrate", "relay", "--sink", "stdout", "--dsn", dsn,
             "--batch-size", "20", "--poll-interval", "0.2", "--sink-timeout", "1",
             "--session-timeout", str(SESSION_TIMEOUT_S), "--shards", "4", *extra],
            stdout=stdout, stderr=stderr, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip


_SHARD_LOCKS = (
    "locktype = 'advisory' AND objsubid = 2 AND mode = 'ExclusiveLock' "
    "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "AND classid::int8 = (hashtext('outbox-migrate.relay:public.outbox_new')::int8 & 4294967295)"
)
"""A relay's shard locks on the test outbox — not its idle flag (patterns/notify.py), also an
exclusive two-key advisory lock, held while the relay waits for work: counting it made a
lone idle relay look like it held five shards of four (a CI flake)."""


def _locks_of(conn: psycopg.Connection, pid: int) -> int:
    row = conn.execute(
        f"SELECT count(*) FROM pg_locks WHERE {_SHARD_LOCKS} AND pid = %s",
        (pid,),
    ).fetchone()
    return int(row[0]) if row else 0


def _relay_pids(conn: psycopg.Connection) -> dict[int, int]:
    """Backend pid → shards held, for every session holding shard locks."""
    rows = conn.execute(
        f"SELECT pid, count(*) FROM pg_locks WHERE {_SHARD_LOCKS} GROUP BY pid"
    ).fetchall()
    return {int(pid): int(n) for pid, n in rows}


def _wait(predicate, timeout_s: float, step_s: float = 0.05) -> float:  # type: ignore[no-untyped-def]
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"not within {timeout_s} s")
        time.sleep(step_s)
    return time.monotonic() - started


def _session_of(conn: psycopg.Connection, pid: int) -> object:
    """What the server says about a session: why it was not ended, when a wait fails."""
    return conn.execute(
        "SELECT state, now() - state_change, wait_event_type, wait_event, left(query, 120), "
        "(SELECT setting FROM pg_settings WHERE name = 'idle_session_timeout') "
        "FROM pg_stat_activity WHERE pid = %s",
        (pid,),
    ).fetchone()


def _published_ids(path: Path) -> list[int]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines() if line.strip()]


def test_a_paused_relays_shards_move_within_the_session_timeout(
    dsn: str, partitioned: psycopg.Connection, tmp_path: Path
) -> None:
    paused_out, other_out = tmp_path / "paused.jsonl", tmp_path / "other.jsonl"
    paused = _relay_process(dsn, paused_out)
    other: subprocess.Popen[bytes] | None = None
    try:
        _wait(lambda: sum(_relay_pids(partitioned).values()) == 4, 20)
        (paused_backend,) = _relay_pids(partitioned)
        other = _relay_process(dsn, other_out)
        _wait(lambda: len(_relay_pids(partitioned)) == 2, 20)
        _wait(lambda: _locks_of(partitioned, paused_backend) == 2, 20)
        paused.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        insert_rows(partitioned, "outbox_new", 400, spec=SPEC)
        # The paused relay's two shards stall until PostgreSQL ends its session.
        try:
            _wait(lambda: not ids_in(partitioned, "outbox_unpublished"), 30)
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}; the paused session: {_session_of(partitioned, paused_backend)}"
            ) from None
        recovered_s = time.monotonic() - stopped_at
        assert _locks_of(partitioned, paused_backend) == 0
        # bound: session timeout + poll interval (idle session) + rebalance + slack
        assert recovered_s < SESSION_TIMEOUT_S + 0.2 + 1.0 + 2.5, recovered_s
        assert recovered_s > SESSION_TIMEOUT_S - 1.0, "the shards moved before the timeout"
    finally:
        paused.send_signal(signal.SIGCONT)
        for process in (paused, other):
            if process is not None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
    published = _published_ids(paused_out) + _published_ids(other_out)
    assert set(published) == set(ids_in(partitioned, "outbox_new"))


def test_a_silent_shard_holder_whose_idle_timer_is_disarmed_is_ended_by_the_survivors(
    dsn: str, partitioned: psycopg.Connection
) -> None:
    """A relay frozen right after psycopg left pipeline mode (Sync, then Flush: the server
    disarms its idle-session timer on the Flush) sits idle with no server timer armed. Here a
    session with no idle timer at all holds two of the four shards and the membership lock,
    as such a relay would. Before: its shards stayed with it for good and their rows were
    never published; now the live relay ends it after session timeout + poll interval."""
    from outbox_migrate.patterns.notify import ADVISORY_NAMESPACE
    from outbox_migrate.relay import queries

    key = f"{ADVISORY_NAMESPACE}:public.outbox_new"
    frozen = psycopg.connect(dsn, autocommit=True)
    frozen.execute("SET idle_session_timeout = 0")
    frozen.execute(queries.named("join-members"), {"key": f"{key}:members"})
    frozen.execute(
        queries.named("try-lock-shards"), {"key": key, "shards": [0, 1], "limit": 2}
    ).fetchall()
    insert_rows(partitioned, "outbox_new", 200, spec=SPEC)
    collected = Collected()
    options = RelayOptions(
        shards=4,
        batch_size=20,
        listen=False,
        poll_interval_s=0.1,
        session_timeout_s=3.0,
        sink_timeout_s=0.5,
    )
    relay = Relay(dsn, collected.factory(), spec=SPEC, options=options)
    try:
        with running(relay):
            took = _wait(lambda: not ids_in(partitioned, "outbox_unpublished"), 20)
        with pytest.raises(psycopg.OperationalError):
            frozen.execute("SELECT 1")
    finally:
        frozen.close()
    # session timeout + poll interval + margin, then the next rebalance takes the shards
    assert took < 3.0 + 0.1 + REAP_MARGIN_S + 1.0 + 2.0, took
    assert sorted(collected.ids) == ids_in(partitioned, "outbox_new")


def test_a_relay_without_its_broker_leaves_its_shards_to_the_others(
    dsn: str, partitioned: psycopg.Connection
) -> None:
    def unreachable(batch: Sequence[Message]) -> None:
        raise SinkUnavailable("collect", "connect timeout (test: broker partitioned away)")

    cut_off, healthy = Collected(), Collected()
    options = RelayOptions(
        shards=4, batch_size=20, listen=False, poll_interval_s=0.05,
        backoff_base_s=1.0, backoff_cap_s=2.0,
    )  # fmt: skip
    first = Relay(dsn, cut_off.factory(unreachable), spec=SPEC, options=options)
    second = Relay(dsn, healthy.factory(), spec=SPEC, options=options)
    with running(first), running(second):
        time.sleep(3.0)  # both joined, shards split
        insert_rows(partitioned, "outbox_new", 300, spec=SPEC)
        took = _wait(lambda: not ids_in(partitioned, "outbox_unpublished"), 15)
    assert took < 8.0
    assert sorted(healthy.ids) == ids_in(partitioned, "outbox_new")
    assert first.stats.sink_failures >= 1
    assert cut_off.ids == []


def test_readyz_means_holding_shards_or_standing_by(
    dsn: str, partitioned: psycopg.Connection
) -> None:
    from outbox_migrate_harness.testing.server import free_port

    from outbox_migrate.relay.metrics import PrometheusObserver, serve

    pytest.importorskip("prometheus_client")
    observers = [PrometheusObserver(), PrometheusObserver()]
    ports = [free_port(), free_port()]
    servers = [serve(o, "127.0.0.1", p) for o, p in zip(observers, ports, strict=True)]

    def get(port: int, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, ""

    options = RelayOptions(shards=1, listen=False, poll_interval_s=0.05)
    relays = [
        Relay(dsn, Collected().factory(), spec=SPEC, options=options, observer=o) for o in observers
    ]
    try:
        assert get(ports[0], "/readyz")[0] == 503  # nothing proven yet
        with running(relays[0]):
            _wait(lambda: get(ports[0], "/readyz")[0] == 200, 10)
            with running(relays[1]):
                _wait(lambda: get(ports[1], "/readyz")[0] == 200, 10)  # the standby
                owned = []
                for port in ports:
                    body = get(port, "/metrics")[1]
                    (line,) = [
                        ln
                        for ln in body.splitlines()
                        if ln.startswith("outbox_relay_shards_owned ")
                    ]
                    owned.append(float(line.split()[1]))
                    assert "outbox_relay_ready 1.0" in body
                assert sorted(owned) == [0.0, 1.0]
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def test_worker_sessions_carry_the_dead_session_settings(
    dsn: str, partitioned: psycopg.Connection
) -> None:
    from outbox_migrate.db import connect

    with connect(dsn, params=keepalive.libpq_params(6.0)) as conn:
        keepalive.configure_session(conn, 6.0, 1.0)
        shown = {
            name: conn.execute(f"SHOW {name}").fetchone()[0]  # type: ignore[index]
            for name in ("tcp_user_timeout", "idle_in_transaction_session_timeout",
                         "idle_session_timeout", "tcp_keepalives_interval")
        }  # fmt: skip
        assert conn.info.get_parameters().get("tcp_user_timeout") == "6000"
    assert shown["tcp_user_timeout"] == "6000"
    assert shown["idle_in_transaction_session_timeout"] == "6s"
    assert shown["idle_session_timeout"] == "7s"


class _Reasons(Observer):
    def __init__(self) -> None:
        self.reasons: list[str] = []

    def failed(self, reason: str, count: int = 1) -> None:
        self.reasons.append(reason)


def test_a_batch_whose_lease_cannot_be_proven_long_enough_is_not_published(
    dsn: str, partitioned: psycopg.Connection, collected: Collected
) -> None:
    """The claim comes back 2.5 s after it was sent (a lock holds it up): with a 5 s session
    timeout and a 3 s sink timeout the lease is only proven for 1 s beyond the claim, so the
    fence refuses the batch; the next claim, fast again, publishes every row once.

    The relay is idle (its statements prepared) before the lock is taken: preparing the claim
    waits for the lock too, and a claim sent after a slow PREPARE is proven fresh."""
    observer = _Reasons()
    options = RelayOptions(
        listen=False, poll_interval_s=0.05, sink_timeout_s=3.0, session_timeout_s=5.0
    )
    relay = Relay(dsn, collected.factory(), spec=SPEC, options=options, observer=observer)
    with running(relay):
        time.sleep(1.0)  # started, nothing to publish: it claims every poll interval
        with psycopg.connect(dsn) as blocker:
            insert_rows(blocker, "outbox_new", 50, spec=SPEC)  # committed with the lock's end
            blocker.execute("LOCK TABLE outbox_unpublished IN ACCESS EXCLUSIVE MODE")
            time.sleep(2.5)
            assert collected.ids == []
        _wait(lambda: not ids_in(partitioned, "outbox_unpublished"), 15)
    assert "fenced" in observer.reasons
    assert sorted(collected.ids) == ids_in(partitioned, "outbox_new")
    assert collected.duplicates() == 0
