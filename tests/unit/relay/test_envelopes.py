"""CloudEvents 1.0 mapping and the `envelope` option (pure; the brokers' side is in
tests/integration/relay/sinks/test_headers.py)."""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime

import pytest

from outbox_migrate.errors import RelayError
from outbox_migrate.relay.message import Message, TextIdMessage
from outbox_migrate.relay.sinks import SinkConfig
from outbox_migrate.relay.sinks.envelopes import CloudEvents, Envelope, envelope_option
from outbox_migrate.relay.sinks.http import header_value
from outbox_migrate.relay.sinks.stdout import StdoutSink
from outbox_migrate.relay.sinks.urls import require_scheme

NOW = datetime(2026, 5, 4, 3, 2, 1, tzinfo=UTC).isoformat()
MESSAGE = Message(5, "public.outbox", "Placed", 'k"1', '{"a": [1, 2]}', NOW, (("tp", "x"),))


def test_structured_mode_is_valid_json_with_the_payload_as_data() -> None:
    event = json.loads(CloudEvents({"ce_source": "urn:shop"}).structured(MESSAGE))
    assert event == {
        "specversion": "1.0", "id": "5", "source": "urn:shop", "type": "Placed",
        "datacontenttype": "application/json", "time": "2026-05-04T03:02:01+00:00",
        "subject": 'k"1', "tp": "x", "data": {"a": [1, 2]},
    }  # fmt: skip


def test_structured_mode_carries_the_rows_headers() -> None:
    """stdout and Redis have no headers beside a structured event: the row's headers go
    into it — as extension attributes where the name is one, the rest under
    `outboxheaders` — and none can replace a spec attribute."""
    traced = Message(
        7, "public.outbox", "Placed", None, "{}", NOW,
        (("traceparent", "00-4bf9-00f0-01"), ("Tenant-Id", "acme"), ("id", "forged")),
    )  # fmt: skip
    event = json.loads(CloudEvents({}).structured(traced))
    assert event["traceparent"] == "00-4bf9-00f0-01"
    assert json.loads(event["outboxheaders"]) == {"Tenant-Id": "acme"}
    assert event["id"] == "7"


def test_binary_headers_prefix_attributes_and_keep_the_relay_headers() -> None:
    headers = CloudEvents({}).binary_headers(MESSAGE, "ce_", content_type=False)
    assert "ce_datacontenttype" not in headers and headers["ce_id"] == "5"
    assert headers["outbox-id"] == "5" and headers["tp"] == "x"
    keyless = Message(6, "t", None, None, "{}", NOW)
    headers = CloudEvents({"ce_type": "shop.event"}).binary_headers(keyless, "ce-")
    assert headers["ce-type"] == "shop.event" and "ce-subject" not in headers


def test_envelope_option_is_checked() -> None:
    assert envelope_option({}, "kafka", Envelope.raw) is Envelope.raw
    assert envelope_option({"envelope": "CloudEvents"}, "x", Envelope.raw) is Envelope.cloudevents
    with pytest.raises(RelayError, match="envelope='xml'"):
        envelope_option({"envelope": "xml"}, "kafka", Envelope.raw)


def test_stdout_writes_structured_cloudevents_on_request() -> None:
    out = io.StringIO()
    StdoutSink(SinkConfig(extra={"envelope": "cloudevents"}), stream=out).publish([MESSAGE])
    assert json.loads(out.getvalue())["data"] == {"a": [1, 2]}


@pytest.mark.parametrize("limit", [None, 1_000_000])
def test_stdout_quotes_application_ids(limit: int | None) -> None:
    """A text id is a JSON string on the line, with or without a size limit (found: the fast
    path wrote `"id":a-1`, which no consumer can parse)."""
    out = io.StringIO()
    sink = StdoutSink(SinkConfig(max_message_bytes=limit), stream=out)
    sink.publish([TextIdMessage("a-1", "outbox", None, None, '{"n":1}', "2026-01-01T00:00:00Z")])
    assert json.loads(out.getvalue())["id"] == "a-1"


def test_http_header_values_are_percent_encoded_only_when_needed() -> None:
    assert header_value("00-ab-01") == "00-ab-01"
    assert header_value("café\n") == "caf%C3%A9%0A"


@pytest.mark.parametrize(
    ("url", "bare", "expected"),
    [
        ("kafka://a:9092,kafka://b:9092", True, "a:9092,b:9092"),
        ("a:9092,b:9092", True, "a:9092,b:9092"),
        ("nats://u:p@h:4222", False, "nats://u:p@h:4222"),
        (None, False, None),
    ],
)
def test_require_scheme_accepts(url: str | None, bare: bool, expected: str | None) -> None:
    assert require_scheme("s", url, ("kafka", "nats"), bare=bare) == expected


def test_require_scheme_refuses_and_masks_the_password() -> None:
    with pytest.raises(RelayError) as caught:
        require_scheme("nats", "ftp://user:secret@x", ("nats",))
    assert "secret" not in str(caught.value) and "'ftp'" in str(caught.value)
