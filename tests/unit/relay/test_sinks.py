"""Sink decisions without a broker: which HTTP posts may overlap, RabbitMQ confirm bookkeeping,
and the HTTP sink's concurrency, order, retries and refusals against a webhook on loopback."""

from __future__ import annotations

import base64
import time
from datetime import UTC, datetime

import pytest

from outbox_migrate.errors import MessagesRejected, RelayError, SinkUnavailable
from outbox_migrate.relay.message import Message
from outbox_migrate.relay.options import Ordering
from outbox_migrate.relay.sinks import SinkConfig, factory
from outbox_migrate.relay.sinks.http import posting_groups
from outbox_migrate.relay.sinks.rabbitmq import Confirms
from tests.support.webhook import Webhook

NOW = datetime(2025, 1, 1, tzinfo=UTC).isoformat()


def message(id_: int, key: str | None = None) -> Message:
    return Message(id_, "public.outbox", "event", key, f'{{"n":{id_}}}', NOW)


def batch(count: int, keys: int | None = None) -> list[Message]:
    """`count` messages with ids 1..count; keys k0..k{keys-1} round-robin, or no key."""
    return [message(i, None if keys is None else f"k{i % keys}") for i in range(1, count + 1)]


# -- posting_groups (pure) ----------------------------------------------------------------


@pytest.mark.parametrize("ordering", [None, Ordering.global_])
def test_global_or_unknown_ordering_is_one_group_in_batch_order(ordering) -> None:
    messages = batch(6, keys=3)
    assert posting_groups(messages, ordering) == [messages]
    assert posting_groups([], ordering) == []


def test_key_ordering_groups_by_key_and_keeps_keyless_messages_together() -> None:
    messages = [message(1, "a"), message(2), message(3, "b"), message(4, "a"), message(5)]
    groups = posting_groups(messages, Ordering.key)
    assert [[m.id for m in g] for g in groups] == [[1, 4], [2, 5], [3]]


def test_none_ordering_keeps_keys_together_but_frees_keyless_messages() -> None:
    messages = [message(1, "a"), message(2), message(3, "a"), message(4)]
    groups = posting_groups(messages, Ordering.none)
    assert [[m.id for m in g] for g in groups] == [[1, 3], [2], [4]]


# -- Confirms (pure) ----------------------------------------------------------------------


def confirms_for(*ids: int) -> Confirms:
    confirms = Confirms()
    confirms.start_batch()
    for outbox_id in ids:
        confirms.sent(outbox_id)
    return confirms


def test_confirms_single_and_multiple_acks_settle_the_batch() -> None:
    confirms = confirms_for(10, 11, 12, 13)
    confirms.confirmed(2, multiple=False, ack=True)
    assert not confirms.settled and set(confirms.pending) == {1, 3, 4}
    confirms.confirmed(3, multiple=True, ack=True)
    assert confirms.pending == {4: 13}
    confirms.confirmed(4, multiple=False, ack=True)
    assert confirms.settled and confirms.nacked == [] and confirms.returned == {}


def test_confirms_nacks_name_outbox_ids_and_tags_continue_across_batches() -> None:
    confirms = confirms_for(10, 11, 12)
    confirms.confirmed(2, multiple=True, ack=False)
    confirms.confirmed(3, multiple=False, ack=True)
    assert confirms.settled and confirms.nacked == [10, 11]
    confirms.start_batch()
    confirms.sent(20)  # the channel's 4th publish
    assert confirms.pending == {4: 20} and confirms.nacked == []
    confirms.returned[20] = "unroutable: 312 NO_ROUTE"
    confirms.confirmed(4, multiple=True, ack=True)
    assert confirms.settled and confirms.returned == {20: "unroutable: 312 NO_ROUTE"}


def test_confirms_ignore_tags_already_settled() -> None:
    confirms = confirms_for(1, 2)
    confirms.confirmed(1, multiple=False, ack=True)
    confirms.confirmed(1, multiple=False, ack=False)
    confirms.confirmed(2, multiple=True, ack=True)
    assert confirms.settled and confirms.nacked == []


# -- HttpSink against a webhook on loopback --------------------------------------------------


@pytest.fixture
def http_sink():
    from outbox_migrate.relay.sinks.http import HttpSink

    sinks: list[HttpSink] = []

    def build(
        url: str, ordering: Ordering | None = Ordering.key, timeout_s: float = 5, **extra: str
    ) -> HttpSink:
        sink = HttpSink(SinkConfig(url=url, timeout_s=timeout_s, extra=extra, ordering=ordering))
        sinks.append(sink)
        return sink

    yield build
    for sink in sinks:
        sink.close()


def slow_every(n: int, delay_s: float):
    def respond(body) -> tuple[int, float]:
        return 204, (delay_s if body["id"] % n == 0 else 0.0)

    return respond


def test_concurrent_posts_keep_per_key_order(http_sink) -> None:
    messages = batch(80, keys=6)
    keys = {m.id: m.key for m in messages}
    with Webhook(slow_every(7, 0.05)) as hook:
        http_sink(hook.url, Ordering.key, concurrency="4").publish(messages)
    assert sorted(hook.accepted) == [m.id for m in messages]
    assert len(hook.arrived) == len(messages)
    for key in set(keys.values()):
        arrived = [i for i in hook.arrived if keys[i] == key]
        assert arrived == sorted(arrived), f"key {key} out of order"
    assert 1 < hook.max_in_flight <= 4
    assert hook.arrived != sorted(hook.arrived)  # the slow ones were overtaken by other keys


def test_keyless_messages_stay_in_order_under_key_ordering_only(http_sink) -> None:
    with Webhook(slow_every(3, 0.03)) as hook:
        http_sink(hook.url, Ordering.key).publish(batch(20))
    assert hook.arrived == list(range(1, 21)) and hook.max_in_flight == 1
    with Webhook(slow_every(3, 0.03)) as hook:
        http_sink(hook.url, Ordering.none).publish(batch(20))
    assert sorted(hook.accepted) == list(range(1, 21)) and hook.max_in_flight > 1


@pytest.mark.parametrize("ordering", [None, Ordering.global_])
def test_global_or_unknown_ordering_posts_one_at_a_time_in_id_order(http_sink, ordering) -> None:
    with Webhook(slow_every(5, 0.02)) as hook:
        http_sink(hook.url, ordering, concurrency="16").publish(batch(30, keys=30))
    assert hook.arrived == list(range(1, 31))
    assert hook.max_in_flight == 1


def test_headers_and_envelope_per_message(http_sink) -> None:
    with Webhook() as hook:
        http_sink(hook.url).publish([message(7, "a")])
    assert hook.bodies == [{"id": 7, "table": "public.outbox", "event_type": "event", "key": "a",
                            "created_at": NOW, "payload": {"n": 7}}]  # fmt: skip
    headers = {k.lower(): v for k, v in hook.headers[0].items()}
    assert headers["idempotency-key"] == headers["x-outbox-id"] == "7"
    assert headers["x-event-type"] == "event"


def test_4xx_rejects_exactly_those_ids_and_acks_the_rest(http_sink) -> None:
    def respond(body) -> tuple[int, float]:
        return (422 if body["id"] % 4 == 0 else 200), 0.0

    with Webhook(respond) as hook, pytest.raises(MessagesRejected) as info:
        http_sink(hook.url, retries="0").publish(batch(20, keys=3))
    assert info.value.rejected == {i: "HTTP 422" for i in (4, 8, 12, 16, 20)}
    assert sorted(hook.accepted) == [i for i in range(1, 21) if i % 4]
    assert len(hook.arrived) == 20  # a 4xx is not retried


def test_retryable_statuses_are_retried_then_acknowledged(http_sink) -> None:
    seen: dict[int, int] = {}

    def respond(body) -> tuple[int, float]:
        seen[body["id"]] = seen.get(body["id"], 0) + 1
        return (429 if seen[body["id"]] == 1 and body["id"] % 2 else 204), 0.0

    with Webhook(respond) as hook:
        http_sink(hook.url).publish(batch(10, keys=10))
    assert sorted(hook.accepted) == list(range(1, 11))
    assert len(hook.arrived) == 15


SLOW_S = 2.0


def test_exhausted_retries_stop_the_batch_after_the_requests_in_flight(http_sink) -> None:
    """Id 3 always gets 503; 4, 5 and 6 are slow. Once 3 is hopeless nothing new starts (7, 8
    never leave), and publish raises only when the requests in flight were answered. (Slow
    = 2 s: 3's three attempts must end before a slow one frees its slot, also on a loaded
    machine.)"""

    def respond(body) -> tuple[int, float]:
        if body["id"] == 3:
            return 503, 0.0
        return 204, (SLOW_S if body["id"] > 3 else 0.0)

    with Webhook(respond) as hook:
        sink = http_sink(hook.url, retries="2", concurrency="4")
        started = time.monotonic()
        with pytest.raises(SinkUnavailable, match="HTTP 503 after 3 attempts"):
            sink.publish(batch(8, keys=8))
        elapsed = time.monotonic() - started
        assert hook.in_flight == 0
        assert SLOW_S <= elapsed < SLOW_S + 3
        assert set(hook.arrived) == {1, 2, 3, 4, 5, 6} and hook.arrived.count(3) == 3
        # The sink stays usable for the next batch (the relay rebuilds it anyway).
        hook.respond = lambda body: (204, 0.0)
        sink.publish([message(100, "a")])
    assert 100 in hook.accepted


def test_a_hung_request_holds_a_failed_batch_at_most_its_timeout(http_sink) -> None:
    def respond(body) -> tuple[int, float]:
        return (503, 0.0) if body["id"] == 1 else (204, 30.0)

    with Webhook(respond) as hook:
        sink = http_sink(hook.url, timeout_s=0.5, retries="1", concurrency="4")
        started = time.monotonic()
        with pytest.raises(SinkUnavailable, match="HTTP 503 after 2 attempts"):
            sink.publish(batch(4, keys=4))
        assert time.monotonic() - started < 3
        assert sorted(set(hook.arrived)) == [1, 2, 3, 4]


def test_a_slow_webhook_ends_the_publish_at_the_sink_timeout_naming_what_it_acknowledged(
    http_sink,
) -> None:
    """One request at a time (strict order), 0.2 s each, 20 messages, a 1-s sink timeout: the
    publish ends after about 1 s — not 4 s — with `SinkUnavailable` naming the messages
    answered with a 2xx, the first ones in order. Fails before: each request had the whole
    timeout, the publish took 4 s (the polling relay's claim transaction with it)."""
    with Webhook(lambda body: (204, 0.2)) as hook:
        sink = http_sink(hook.url, None, timeout_s=1.0)
        started = time.monotonic()
        with pytest.raises(SinkUnavailable, match=r"--sink-timeout\) are spent") as info:
            sink.publish(batch(20))
        elapsed = time.monotonic() - started
        acked = info.value.acknowledged
        # Ends at the timeout, far before the 4 s of a per-request timeout, on a loaded
        # machine too (fewer requests then fit in the second, never more than five).
        assert 0.9 <= elapsed < 3.0, elapsed
        assert 1 <= len(acked) <= 5 and acked == list(range(1, len(acked) + 1))
        assert hook.accepted[: len(acked)] == acked


def test_retries_stop_when_the_publish_has_no_time_left(http_sink) -> None:
    """Ten retries of a 503 would back off for about 100 s; within a 0.5-s sink timeout the
    batch is unavailable after 0.5 s, nothing acknowledged."""
    with Webhook(lambda body: (503, 0.0)) as hook:
        sink = http_sink(hook.url, timeout_s=0.5, retries="10")
        started = time.monotonic()
        with pytest.raises(SinkUnavailable, match="HTTP 503") as info:
            sink.publish(batch(2, keys=2))
        assert time.monotonic() - started < 0.8
        assert info.value.acknowledged == [] and hook.arrived.count(1) < 11


def test_unreachable_webhook_is_unavailable(http_sink) -> None:
    from outbox_migrate_harness.testing.server import free_port

    sink = http_sink(f"http://127.0.0.1:{free_port()}/hook", retries="1")
    with pytest.raises(SinkUnavailable, match="ConnectionRefusedError"):
        sink.publish(batch(3, keys=3))


def test_batch_mode_posts_one_array_per_batch(http_sink) -> None:
    with Webhook() as hook:
        http_sink(hook.url, Ordering.none, batch="true").publish(batch(25, keys=4))
    assert len(hook.bodies) == 1
    assert [e["id"] for e in hook.bodies[0]] == list(range(1, 26))
    assert hook.accepted == list(range(1, 26))


def test_batch_mode_refusal_rejects_the_whole_batch(http_sink) -> None:
    with Webhook(lambda body: (400, 0.0)) as hook, pytest.raises(MessagesRejected) as info:
        http_sink(hook.url, batch="yes").publish(batch(3))
    assert info.value.rejected == {1: "HTTP 400", 2: "HTTP 400", 3: "HTTP 400"}


def test_batch_mode_a_refused_array_is_halved_until_the_refused_message_is_found(
    http_sink,
) -> None:
    """A 422 for an array holding id 7 used to refuse all 20 (and dead-letter them together);
    the halves without 7 are accepted, 7 alone is refused."""

    def respond(body: list[dict[str, int]]) -> tuple[int, float]:
        return (422 if any(e["id"] == 7 for e in body) else 204), 0.0

    with Webhook(respond) as hook, pytest.raises(MessagesRejected) as info:
        http_sink(hook.url, Ordering.none, batch="true").publish(batch(20))
    assert info.value.rejected == {7: "HTTP 422"}
    assert sorted(hook.accepted) == [i for i in range(1, 21) if i != 7]
    assert len(hook.bodies) <= 2 * 5 + 1  # about 2·log2(20) arrays, not one per message


def test_batch_mode_an_endpoint_refusal_is_not_halved(http_sink) -> None:
    with Webhook(lambda body: (401, 0.0)) as hook, pytest.raises(MessagesRejected) as info:
        http_sink(hook.url, batch="true").publish(batch(4))
    assert info.value.rejected == dict.fromkeys(range(1, 5), "HTTP 401")
    assert len(hook.bodies) == 1


@pytest.mark.parametrize(
    "extra", [{"concurrency": "0"}, {"concurrency": "many"}, {"retries": "-1"}, {"batch": "maybe"}]
)
def test_bad_http_options_are_refused(http_sink, extra: dict[str, str]) -> None:
    with pytest.raises(RelayError, match="http sink"):
        http_sink("http://127.0.0.1:9/hook", **extra)


def test_rabbitmq_reads_max_message_size_from_the_channel_close_text() -> None:
    from outbox_migrate.relay.sinks.rabbitmq import too_large_limit

    text = "PRECONDITION_FAILED - message size 70000 is larger than configured max size 65536"
    assert too_large_limit(406, text) == 65536
    assert too_large_limit(406, "PRECONDITION_FAILED - inequivalent arg 'durable'") is None
    assert too_large_limit(404, text) is None  # another close: an outage, as before
    assert too_large_limit(None, None) is None


def test_rabbitmq_confirms_remember_what_was_acked_in_the_batch() -> None:
    confirms = confirms_for(7, 8, 9)
    confirms.confirmed(2, multiple=True, ack=True)
    assert confirms.acked == [7, 8] and not confirms.settled
    confirms.start_batch()
    assert confirms.acked == []


def test_header_names_and_values_http_cannot_carry_are_not_an_outage(http_sink) -> None:
    """A non-ASCII event type made httpx raise UnicodeEncodeError out of the sink, a newline
    one was retried as a "connection error" for ever, and so was a row's header whose name is
    not an HTTP token: now the value is percent-encoded, the message with the bad name refused."""
    odd = [
        Message(2, "public.outbox", "é", None, "{}", NOW),
        Message(3, "public.outbox", "a\nb", None, "{}", NOW),
        Message(4, "public.outbox", "e", None, "{}", NOW, (("bad name", "v"),)),
        Message(5, "public.outbox", "e", None, "{}", NOW, (("nämé", "v"),)),
    ]
    with Webhook() as hook, pytest.raises(MessagesRejected) as info:
        http_sink(hook.url, retries="0").publish([message(1), *odd])
    assert sorted(info.value.rejected) == [4, 5]
    assert "not an HTTP token" in info.value.rejected[4]
    assert sorted(hook.accepted) == [1, 2, 3]
    sent = {h["X-Outbox-Id"]: h["X-Event-Type"] for h in hook.headers}
    assert (sent["2"], sent["3"]) == ("%C3%A9", "a%0Ab")


def test_credentials_in_the_url_become_basic_auth(http_sink) -> None:
    """The sink's own client (http.client) sends what httpx did for a URL with a user and a
    percent-encoded password: `Authorization: Basic`, decoded before encoding."""
    with Webhook() as hook:
        url = hook.url.replace("http://", "http://relay:p%40ss@")
        http_sink(url).publish(batch(2, keys=2))
    expected = "Basic " + base64.b64encode(b"relay:p@ss").decode()
    assert [h["Authorization"] for h in hook.headers] == [expected, expected]


def test_an_http_proxy_from_the_environment_carries_the_posts(http_sink, monkeypatch) -> None:
    """`http_proxy` names the webhook itself as the proxy: the sink sends each POST there in
    absolute form, so the request reaches it although the URL's host does not exist."""
    with Webhook() as hook:
        monkeypatch.setenv("http_proxy", hook.url.removesuffix("/hook"))
        monkeypatch.setenv("no_proxy", "")
        http_sink("http://webhook.invalid:8080/hook").publish(batch(3, keys=3))
    assert sorted(hook.accepted) == [1, 2, 3]
    assert {h["Host"] for h in hook.headers} == {"webhook.invalid:8080"}


def test_a_client_library_without_the_internals_a_sink_writes_through_is_refused_at_start() -> None:
    """The NATS and RabbitMQ sinks write through methods that are not their library's public
    API: a release that renamed them must stop the relay with one line, not fail every
    publish as an outage retried for ever."""
    from nats.aio.client import Client
    from pika.adapters.asyncio_connection import AsyncioConnection

    from outbox_migrate.relay.sinks import require_internals

    require_internals("nats", "nats-py", Client, ("_send_command", "_flush_pending"))
    require_internals("rabbitmq", "pika", AsyncioConnection, ("_adapter_emit_data",))

    class Renamed:
        async def _flush_pending(self) -> None: ...

    with pytest.raises(RelayError) as raised:
        require_internals("nats", "nats-py", Renamed, ("_send_command", "_flush_pending"))
    line = str(raised.value)
    assert line.startswith("sink nats: nats-py 2.") and "has no Renamed._send_command," in line
    assert "_flush_pending" not in line and "outbox-migrate[nats]" in line and "\n" not in line


# -- URLs and options, checked when the sink is built -------------------------------------

BAD_URLS = [
    ("redis", "redis://:s3cret@127.0.0.1:notaport/0", "Port could not be cast"),
    ("redis", "redis://127.0.0.1:6379/abc", "the path names the database"),
    ("http", "http://u:s3cret@[::1", "Invalid IPv6 URL"),
    ("nats", "nats://u:s3cret@127.0.0.1:notaport", "Port could not be cast"),
    ("rabbitmq", "amqp://guest:s3cret@127.0.0.1:99999/%2F", "Port out of range"),
    ("rabbitmq", "amqp://guest:s3cret@127.0.0.1:5672/%2F?heartbeat=abc", "heartbeat"),
    ("kafka", "127.0.0.1:9092,127.0.0.1:x", "Port could not be cast"),
]


@pytest.mark.parametrize(("sink", "url", "why"), BAD_URLS)
def test_a_malformed_sink_url_stops_the_relay_at_start_with_the_password_masked(
    sink: str, url: str, why: str
) -> None:
    """A bad port or database was an internal error (exit 1), an outage retried for ever
    (nats) or, for a Redis database that is not a number, database 0 in silence; RabbitMQ's
    message printed the URL's password."""
    with pytest.raises(RelayError) as caught:
        factory(sink, SinkConfig(url=url))()
    assert why in str(caught.value)
    assert "s3cret" not in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("sink", "url", "typo"),
    [
        ("stdout", None, "maxlenn"),
        ("kafka", None, "linger_ms"),
        ("rabbitmq", None, "exchnage"),
        ("nats", None, "streams"),
        ("redis", None, "maxlenn"),
        ("http", "http://127.0.0.1:9/hook", "retires"),
    ],
)
def test_an_option_the_sink_does_not_read_is_refused_naming_it(
    sink: str, url: str | None, typo: str
) -> None:
    """A misspelt option was ignored in silence while the operator believed it applied."""
    with pytest.raises(RelayError, match=f"unknown --sink-option '{typo}'"):
        factory(sink, SinkConfig(url=url, extra={typo: "1"}))()


def test_every_documented_option_and_librdkafka_settings_are_accepted() -> None:
    common = {"envelope": "raw", "ce_source": "/svc", "ce_type": "t"}
    http_options = {"retries": "0", "concurrency": "2", "batch": "true"}
    configs = {
        "kafka": SinkConfig(extra={**common, "message.max.bytes": "2000000"}),
        "redis": SinkConfig(url="redis://127.0.0.1:6379/3", extra={**common, "maxlen": "9"}),
        "nats": SinkConfig(extra={**common, "stream": "S", "create_stream": "false"}),
        "rabbitmq": SinkConfig(extra={**common, "exchange": "x"}),
        "http": SinkConfig(url="http://127.0.0.1:9/h", extra={**common, **http_options}),
        "stdout": SinkConfig(extra=common),
    }
    for name, config in configs.items():
        factory(name, config)().close()  # nothing was connected: close only frees the loop
