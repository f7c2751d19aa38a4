"""After a broker outage the relay publishes again within its backoff cap, whatever the
server's idle-session timeout.

The backoff grows past the window in which PostgreSQL ends an idle session (the relay's own
`idle_session_timeout`, session timeout + poll interval, or the server's when the relay sets
none). The worker used to find its session dead only when it woke up: that wake-up went to
"connection lost" and a second full backoff before the broker was tried again (a NATS relay
published nothing in 145 s through three 15-s up windows). Here a private Redis is killed,
the relay backs off up to BACKOFF_CAP_S, and the broker comes back right after a failed
attempt: publishing must resume within RESUME_BOUND_S, and the worker's session must never
have been found lost.
"""

from __future__ import annotations

import time

import psycopg
import pytest
from psycopg import sql

from outbox_migrate.relay.options import RelayOptions
from outbox_migrate.relay.sinks import SinkConfig, factory
from outbox_migrate.relay.worker import Relay, running
from outbox_migrate.testing.schema import insert_rows
from tests.integration.relay.conftest import SPEC, ids_in
from tests.integration.relay.sinks.test_crashes import own_redis  # noqa: F401 - a fixture

pytestmark = [pytest.mark.newest_pg_only, pytest.mark.pg(min=14)]
SERVER_IDLE_SESSION_TIMEOUT = "2s"
BACKOFF_BASE_S = 1.0
BACKOFF_CAP_S = 8.0
"""Equal jitter: the capped delays are 4 to 8 s, every one longer than either idle window."""
CAPPED_FAILURE = 5
"""The 5th failed attempt backs off by the cap (1, 2, 4, 8, 8 ... s before jitter)."""
RESUME_BOUND_S = 10.0
"""The broker returns right after a failed attempt: the next one is at most the cap later."""


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.mark.parametrize(
    "session_timeout_s",
    [pytest.param(0.0, id="server-timeout"), pytest.param(3.5, id="relay-timeout")],
)
def test_publishing_resumes_within_the_backoff_cap_after_an_outage(
    dsn: str,
    partitioned: psycopg.Connection,
    own_redis,  # noqa: F811 - the imported fixture
    session_timeout_s: float,
) -> None:
    url, kill, start = own_redis
    partitioned.execute(
        sql.SQL("ALTER DATABASE {} SET idle_session_timeout = {}").format(
            sql.Identifier(partitioned.info.dbname), sql.Literal(SERVER_IDLE_SESSION_TIMEOUT)
        )
    )
    relay = Relay(
        dsn, factory("redis", SinkConfig(url=url, target="om-recovery", timeout_s=1.0)),
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
