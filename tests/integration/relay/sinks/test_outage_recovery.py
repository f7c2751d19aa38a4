"""After a broker outage the relay publishes again within its backoff cap, whatever the
server's idle-session timeout.

The backoff grows past the window in which PostgreSQL ends an idle session (the relay's own
`idle_session_timeout`, session timeout + poll interval, or the server's when the relay sets
none). The worker used to find its session dead only when it woke up: that wake-up went to
"connection lost" and a second full backoff before the broker was tried again (a NATS relay
published nothing in 145 s through three 15-s up windows). Here a private Redis or NATS
(JetStream) server is killed, the relay backs off up to BACKOFF_CAP_S, and the broker comes
back right after a failed attempt: publishing must resume within RESUME_BOUND_S, and the
worker's session must never have been found lost.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import insert_rows
from outbox_migrate_harness.testing.server import free_port
from psycopg import sql

from outbox_migrate.errors import SinkUnavailable
from outbox_migrate.relay.message import Message
from outbox_migrate.relay.options import RelayOptions
from outbox_migrate.relay.sinks import SinkConfig, factory
from outbox_migrate.relay.worker import Relay, running
from tests.integration.relay.conftest import SPEC, Collected, ids_in
from tests.integration.relay.sinks.conftest import client, unavailable, wait_port
from tests.integration.relay.sinks.test_crashes import own_redis  # noqa: F401 - a fixture

pytestmark = [pytest.mark.newest_pg_only, pytest.mark.pg(min=14)]
SERVER_IDLE_SESSION_TIMEOUT = "2s"
BACKOFF_BASE_S = 1.0
BACKOFF_CAP_S = RelayOptions().backoff_cap_s
"""The relay's default cap (8 s; equal jitter: capped delays of 4 to 8 s, every one longer than
either idle window): the bound below must hold as shipped, not only when tuned."""
CAPPED_FAILURE = 5
"""The 5th failed attempt backs off by the cap (1, 2, 4, 8, 8 ... s before jitter)."""
RESUME_BOUND_S = 10.0
"""The broker returns right after a failed attempt: the next one is at most the cap later."""


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[tuple[str, Callable[[], None], Callable[[], None]]]:
    """A private NATS server with JetStream (its stream survives a restart) that the test may
    kill and start again; the machine's shared one on 4222 is never touched."""
    client("nats", "nats")
    binary = shutil.which("nats-server") or "/usr/sbin/nats-server"
    if not Path(binary).exists():
        unavailable("nats-server is not installed")
    port = free_port()
    command = [binary, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(tmp_path / "js")]
    state: dict[str, subprocess.Popen[bytes]] = {}

    def start() -> None:
        state["p"] = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert wait_port(port, 20), "private nats-server did not start"

    def kill() -> None:
        state["p"].kill()
        state["p"].wait()

    start()
    try:
        yield f"nats://127.0.0.1:{port}", kill, start
    finally:
        if state["p"].poll() is None:
            kill()


@pytest.mark.parametrize(
    ("broker", "session_timeout_s"),
    [
        pytest.param("redis", 0.0, id="redis-server-timeout"),
        pytest.param("redis", 3.5, id="redis-relay-timeout"),
        pytest.param("nats", 3.5, id="nats-relay-timeout"),
    ],
)
def test_publishing_resumes_within_the_backoff_cap_after_an_outage(
    dsn: str,
    partitioned: psycopg.Connection,
    request: pytest.FixtureRequest,
    broker: str,
    session_timeout_s: float,
) -> None:
    url, kill, start = request.getfixturevalue("own_redis" if broker == "redis" else "own_nats")
    target = "om-recovery" if broker == "redis" else "om.recovery"
    partitioned.execute(
        sql.SQL("ALTER DATABASE {} SET idle_session_timeout = {}").format(
            sql.Identifier(partitioned.info.dbname), sql.Literal(SERVER_IDLE_SESSION_TIMEOUT)
        )
    )
    relay = Relay(
        dsn, factory(broker, SinkConfig(url=url, target=target, timeout_s=1.0)),
        spec=SPEC,
        options=RelayOptions(batch_size=50, listen=False, poll_interval_s=0.05,
                             backoff_base_s=BACKOFF_BASE_S, backoff_cap_s=BACKOFF_CAP_S,
                             sink_timeout_s=1.0, session_timeout_s=session_timeout_s),
    )  # fmt: skip
    stats = relay.stats
    with running(relay):
        insert_rows(partitioned, "outbox_new", 100, spec=SPEC)
        wait_for(lambda: not ids_in(partitioned, "outbox_unpublished"), 30, "first rows")
        kill()
        insert_rows(partitioned, "outbox_new", 100, spec=SPEC)
        wait_for(lambda: stats.sink_failures >= CAPPED_FAILURE, 90, "backoff reached its cap")
        failures = stats.sink_failures
        wait_for(lambda: stats.sink_failures > failures, 30, "a failed attempt at the cap")
        start()
        back = time.monotonic()
        wait_for(lambda: not ids_in(partitioned, "outbox_unpublished"), 60, "publishing resumed")
        resumed_s = time.monotonic() - back
    assert stats.connection_retries == 0  # the session was never found dead at a wake-up
    assert resumed_s <= RESUME_BOUND_S, resumed_s
    assert len(ids_in(partitioned, "outbox_published")) == 200


def test_a_session_ended_during_the_backoff_is_reopened_without_a_second_backoff(
    dsn: str,
    partitioned: psycopg.Connection,
    request: pytest.FixtureRequest,
) -> None:
    """The server ends the backing-off worker's session (an administrator, a failover): the
    next ping finds it gone, the worker drops it and opens a new one as its wake-up's first
    step — no "connection lost", no second backoff."""
    url, kill, start = request.getfixturevalue("own_redis")
    relay = Relay(
        dsn, factory("redis", SinkConfig(url=url, target="om-reopen", timeout_s=1.0)),
        spec=SPEC,
        options=RelayOptions(batch_size=50, listen=False, poll_interval_s=0.05,
                             backoff_base_s=BACKOFF_CAP_S, backoff_cap_s=BACKOFF_CAP_S,
                             sink_timeout_s=1.0, session_timeout_s=3.5),
    )  # fmt: skip
    stats = relay.stats
    with running(relay):
        insert_rows(partitioned, "outbox_new", 100, spec=SPEC)
        wait_for(lambda: not ids_in(partitioned, "outbox_unpublished"), 30, "first rows")
        kill()
        insert_rows(partitioned, "outbox_new", 100, spec=SPEC)
        wait_for(lambda: stats.sink_failures >= 1, 30, "a failed attempt")
        pid = relay.shared.conns[0].info.backend_pid
        partitioned.execute("SELECT pg_terminate_backend(%s)", (pid,))
        start()
        back = time.monotonic()
        wait_for(lambda: not ids_in(partitioned, "outbox_unpublished"), 60, "publishing resumed")
        resumed_s = time.monotonic() - back
        reopened = relay.shared.conns[0].info.backend_pid
    assert reopened != pid
    assert stats.connection_retries == 0
    assert resumed_s <= RESUME_BOUND_S, resumed_s


def test_a_session_ended_as_the_broker_fails_is_reopened_without_a_second_backoff(
    dsn: str, partitioned: psycopg.Connection, collected: Collected
) -> None:
    """The session dies between the broker's failure and the backoff (the worker's step-out
    of its shard lease finds it gone): the backoff drops it, and the wake-up opens a new one
    as its first step — not a "connection lost" and a second backoff on the dead one."""
    ended: list[int] = []

    def broker_fails_once_as_the_session_ends(batch: Sequence[Message]) -> None:
        if ended:
            return
        pid = relay.shared.conns[0].info.backend_pid
        with psycopg.connect(dsn, autocommit=True) as admin:  # waits until it is gone
            admin.execute("SELECT pg_terminate_backend(%s, 10000)", (pid,))
        ended.append(pid)
        raise SinkUnavailable("collect", "the broker went away")

    relay = Relay(
        dsn, collected.factory(broker_fails_once_as_the_session_ends), spec=SPEC,
        options=RelayOptions(batch_size=50, listen=False, poll_interval_s=0.05,
                             backoff_base_s=0.2, backoff_cap_s=0.2),
    )  # fmt: skip
    with running(relay):
        insert_rows(partitioned, "outbox_new", 100, spec=SPEC)
        wait_for(lambda: not ids_in(partitioned, "outbox_unpublished"), 60, "every row")
        reopened = relay.shared.conns[0].info.backend_pid
    assert ended and reopened != ended[0]
    assert relay.stats.sink_failures == 1
    assert relay.stats.connection_retries == 0, relay.stats
    assert sorted(collected.ids) == sorted(ids_in(partitioned, "outbox_published"))
