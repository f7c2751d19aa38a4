"""Kafka-protocol sink (confluent-kafka / librdkafka), idempotent producer, acks=all.

Every message of the batch is produced, then `flush` waits for the delivery reports; a
message counts as acknowledged only when its report came back without error. Key: the key
column (`message_key` by default); headers: `Message.headers()` (outbox id, table, event type,
the row's extra headers); body per the `envelope` option (`raw` by default, see envelopes.py;
`cloudevents` = binary content mode with `ce_` headers). Bootstrap servers: `url` (host:port,
or kafka:// / tcp:// URLs); topic: `target`; any option with a dot is a librdkafka setting.

Failures are sorted per message (`classify`): a message the broker or the client refuses for
what it *is* — too large (`message.max.bytes`), an invalid record, a topic this producer may
not write, a topic that does not exist when auto-create is off — is `MessagesRejected` under
its id (attempts → dead-letter table), and the rest of the batch is still acknowledged. A
flush that times out or any other delivery error (broker down, leader moving) is
`SinkUnavailable`: the batch is re-sent later, consumers de-duplicate on `outbox-id`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from outbox_migrate.relay.errors import MessagesRejected, RelayError, SinkUnavailable
from outbox_migrate.relay.message import Message, MessageId
from outbox_migrate.relay.sinks import SinkConfig
from outbox_migrate.relay.sinks.envelopes import CloudEvents, Envelope, envelope_option
from outbox_migrate.relay.sinks.urls import require_scheme

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"
PERMANENT_CODES = frozenset({
    "MSG_SIZE_TOO_LARGE", "INVALID_RECORD", "INVALID_MSG", "RECORD_LIST_TOO_LARGE",
    "TOPIC_AUTHORIZATION_FAILED", "UNKNOWN_TOPIC_OR_PART", "_UNKNOWN_TOPIC",
    "_UNKNOWN_PARTITION", "TOPIC_EXCEPTION", "POLICY_VIOLATION", "_INVALID_ARG",
    "_KEY_SERIALIZATION", "_VALUE_SERIALIZATION",
})  # fmt: skip
"""librdkafka error names that refuse one message for good; anything else is retryable."""


def is_permanent(error: Any) -> bool:
    """True for a KafkaError that refuses the message itself (not the broker being away).

    By name, not number: the client's own check of `message.max.bytes` and the broker's
    answer are different codes with the same name, and names read better in tests and logs.
    A fatal producer error (the idempotent producer lost its sequence) is never per message.
    """
    if error.fatal():
        return False
    return str(error.name()) in PERMANENT_CODES


class KafkaSink:
    name = "kafka"

    def __init__(self, config: SinkConfig) -> None:
        try:
            import confluent_kafka
        except ImportError:
            raise RelayError(
                "the kafka sink needs confluent-kafka: install outbox-migrate[kafka]"
            ) from None
        self._kafka = confluent_kafka
        self.config = config
        self.topic = config.target
        bootstrap = require_scheme(self.name, config.url, ("kafka", "tcp", "plaintext"), bare=True)
        self.envelope = envelope_option(config.extra, self.name, Envelope.raw)
        self.cloudevents = CloudEvents(config.extra)
        settings: dict[str, Any] = {
            "bootstrap.servers": bootstrap or DEFAULT_BOOTSTRAP,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 2,
            "message.timeout.ms": int(config.timeout_s * 1000),
            "socket.timeout.ms": int(config.timeout_s * 1000),
            "logger": _library_logger(),
        }
        settings.update({k: v for k, v in config.extra.items() if "." in k})
        try:
            self.producer: Any = confluent_kafka.Producer(settings)
        except confluent_kafka.KafkaException as exc:
            raise RelayError(f"sink kafka: {exc.args[0].str()}") from None

    def _body_and_headers(self, message: Message) -> tuple[bytes, list[tuple[str, str]]]:
        if self.envelope is Envelope.cloudevents:
            headers = self.cloudevents.binary_headers(message, "ce_", content_type=False)
            headers["content-type"] = "application/json"
            return message.payload_bytes, list(headers.items())
        body = message.envelope().encode() if self.envelope is Envelope.json else None
        return body or message.payload_bytes, list(message.headers().items())

    def publish(self, batch: Sequence[Message]) -> None:
        rejected: dict[MessageId, str] = {}
        retryable: list[str] = []
        delivered = 0

        def report(err: Any, msg: Any) -> None:
            nonlocal delivered
            if err is None:
                delivered += 1
            elif is_permanent(err):
                rejected[_outbox_id(msg)] = f"kafka {err.name()}: {err.str()}"
            else:
                retryable.append(f"{err.name()}: {err.str()}")

        produce, raw = self.producer.produce, self.envelope is Envelope.raw
        for message in batch:
            if raw:  # the hot path: no envelope to build
                value, headers = message.payload_bytes, list(message.headers().items())
            else:
                value, headers = self._body_and_headers(message)
            while True:
                try:
                    produce(
                        self.topic,
                        value=value,
                        key=message.key.encode() if message.key is not None else None,
                        headers=headers,
                        on_delivery=report,
                    )
                    break
                except BufferError:  # local queue full: let deliveries drain first
                    self.producer.poll(0.05)
                except self._kafka.KafkaException as exc:  # refused before it was queued
                    error = exc.args[0]
                    if not is_permanent(error):
                        raise SinkUnavailable(self.name, f"{error.name()}: {error.str()}") from None
                    rejected[message.id] = f"kafka {error.name()}: {error.str()}"
                    break
        remaining = self.producer.flush(self.config.timeout_s)
        if remaining or retryable:
            detail = (
                retryable[0] if retryable else f"{remaining} message(s) not acknowledged in time"
            )
            raise SinkUnavailable(self.name, detail)
        if delivered + len(rejected) != len(batch):
            missing = len(batch) - delivered - len(rejected)
            raise SinkUnavailable(self.name, f"{missing} delivery report(s) missing")
        if rejected:
            raise MessagesRejected(self.name, rejected)

    def close(self) -> None:
        self.producer.flush(1.0)


def _outbox_id(msg: Any) -> int:
    """The outbox id of a reported message, from its `outbox-id` header.

    Read only for failed reports, so the hot path needs no per-message callback closure.
    """
    for name, value in msg.headers() or ():
        if name == "outbox-id":
            return int(value)
    raise SinkUnavailable("kafka", "a failed delivery report without an outbox-id header")


def _library_logger() -> Any:
    """librdkafka's own log lines, through the relay's logger instead of stderr."""
    import logging

    return logging.getLogger("outbox_migrate.relay.sink.kafka")
