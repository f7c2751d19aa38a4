"""`relay --mode cdc` with RabbitMQ going away: pika's own error lines (with tracebacks) reach
the operator's log as one-line `relay.sink_library` events, as in the polling relay."""

from __future__ import annotations

import logging
import time
import uuid
from urllib.parse import urlsplit

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import insert_rows

from outbox_migrate.relay.cdc.relay import CdcRelay, running
from outbox_migrate.relay.options import CdcOptions
from outbox_migrate.relay.sinks import SinkConfig, factory
from tests.integration.relay.cdc.conftest import drop_slots, slot_row, unrouted, wait_for
from tests.integration.relay.conftest import SPEC, ids_in
from tests.support.tcp_proxy import TcpProxy

pytestmark = pytest.mark.newest_pg_only
__all__ = ["unrouted"]  # the fixture: pika's logger as a fresh process has it


@pytest.mark.broker("rabbitmq")
def test_cdc_relay_logs_rabbitmq_going_away_without_tracebacks(
    dsn: str,
    partitioned: psycopg.Connection,
    rabbitmq_url: str,
    unrouted: list[logging.LogRecord],
) -> None:
    upstream = urlsplit(rabbitmq_url).port or 5672
    queue = f"om-cdc-quiet-{uuid.uuid4().hex[:8]}"
    try:
        with TcpProxy(upstream) as proxy:
            url = rabbitmq_url.replace(f":{upstream}/", f":{proxy.port}/")
            sink = factory("rabbitmq", SinkConfig(url=url, target=queue, timeout_s=1.0))
            options = CdcOptions(batch_size=10, backoff_base_s=0.05, backoff_cap_s=0.2)
            relay = CdcRelay(dsn, sink, spec=SPEC, options=options)
            with running(relay):
                wait_for(lambda: (slot_row(partitioned) or (0, False))[1], what="the stream")
                insert_rows(partitioned, "outbox_new", 20, spec=SPEC)
                wait_for(lambda: not ids_in(partitioned, "outbox_unpublished"), what="delivery")
                proxy.cut()
                insert_rows(partitioned, "outbox_new", 20, spec=SPEC)
                time.sleep(1.5)
                proxy.restore()
                wait_for(lambda: not ids_in(partitioned, "outbox_unpublished"), what="the rest")
    finally:
        drop_slots(dsn)
        import pika

        connection = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
        connection.channel().queue_delete(queue)
        connection.close()
    seen = list(unrouted)
    assert relay.stats.sink_failures >= 1
    assert not [(r.name, r.getMessage()) for r in seen if r.exc_info]
    assert not [r.name for r in seen if r.name.startswith(("pika", "aiormq"))]
    routed = [r.getMessage() for r in seen if "relay.sink_library logger=pika" in r.getMessage()]
    assert routed and all("\n" not in m for m in routed)
