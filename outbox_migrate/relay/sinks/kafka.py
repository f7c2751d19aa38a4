"""Kafka-protocol sink (confluent-kafka / librdkafka), idempotent producer, acks=all.

A message counts as acknowledged only once its delivery report came back without error; a
refusal of one message never fails its batch-mates (docs/sinks.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

from outbox_migrate.errors import MessagesRejected, RelayError, SinkUnavailable
from outbox_migrate.relay.message import Message, MessageId
from outbox_migrate.relay.sinks import NotSent, SinkConfig, check_options, client, too_large
from outbox_migrate.relay.sinks.envelopes import (
    CloudEvents,
    Envelope,
    body_bytes,
    content_type,
    envelope_option,
)
from outbox_migrate.relay.sinks.isolation import isolate
from outbox_migrate.relay.sinks.urls import require_scheme

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"
PERMANENT_CODES = frozenset({
    "MSG_SIZE_TOO_LARGE", "INVALID_RECORD", "INVALID_MSG", "RECORD_LIST_TOO_LARGE",
    "TOPIC_AUTHORIZATION_FAILED", "UNKNOWN_TOPIC_OR_PART", "_UNKNOWN_TOPIC",
    "_UNKNOWN_PARTITION", "TOPIC_EXCEPTION", "POLICY_VIOLATION", "_INVALID_ARG",
    "_KEY_SERIALIZATION", "_VALUE_SERIALIZATION",
})  # fmt: skip
"""librdkafka error names that refuse one message for good; anything else is retryable."""
BATCH_WIDE_CODES = frozenset({
    "INVALID_RECORD", "INVALID_MSG", "MSG_SIZE_TOO_LARGE", "RECORD_LIST_TOO_LARGE",
})  # fmt: skip
"""Refusals a broker gives every record of a record batch for one record in it."""
FENCED = "PRODUCER_FENCED"


def is_permanent(error: Any) -> bool:
    """True for a KafkaError that refuses the message itself (not the broker being away). By
    name: the client's own `message.max.bytes` check and the broker's answer differ in code
    only. A fatal producer error (its sequence lost) is never per message."""
    if error.fatal():
        return False
    return str(error.name()) in PERMANENT_CODES


class KafkaSink:
    name = "kafka"

    def __init__(self, config: SinkConfig) -> None:
        self._kafka = client(self.name, "confluent_kafka", "confluent-kafka")
        self.config = config
        self.topic = config.target
        check_options(self.name, config.extra, (), dotted="librdkafka")
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
            "logger": logging.getLogger("outbox_migrate.relay.sink.kafka"),  # not stderr
        }
        settings.update({k: v for k, v in config.extra.items() if "." in k})
        self._settings = settings
        self.limit = config.max_message_bytes
        """None: librdkafka checks its own message.max.bytes before queuing."""
        self.producer: Any = self._new_producer()

    def _new_producer(self) -> Any:
        try:
            return self._kafka.Producer(self._settings)
        except self._kafka.KafkaException as exc:
            raise RelayError(f"sink kafka: {exc.args[0].str()}") from None

    def _body_and_headers(self, message: Message) -> tuple[bytes, list[tuple[str, str]]]:
        if self.envelope is Envelope.cloudevents:
            headers = self.cloudevents.binary_headers(message, "ce_", content_type=False)
            headers["content-type"] = content_type(message)
        else:
            headers = message.headers()
        return body_bytes(message, self.envelope, self.name), list(headers.items())

    def publish(self, batch: Sequence[Message]) -> None:
        deadline = time.monotonic() + self.config.timeout_s
        rejected, batch_wide = self._round(batch, deadline)
        if len(batch_wide) > 1:
            # Refused together: maybe for one record among them. Find it; deliver the rest.
            for outbox_id in batch_wide:
                del rejected[outbox_id]
            suspects = [m for m in batch if m.id in batch_wide]
            try:
                rejected.update(
                    isolate(suspects, lambda g: self._round(g, deadline)[0], deadline, self.name)
                )
            except SinkUnavailable as exc:
                # The first round delivered every message it did not refuse: marked too.
                first = [m.id for m in batch if m.id not in batch_wide and m.id not in rejected]
                raise SinkUnavailable(self.name, exc.reason, [*first, *exc.acknowledged]) from None
        if rejected:
            raise MessagesRejected(self.name, rejected)

    def _round(
        self, batch: Sequence[Message], deadline: float
    ) -> tuple[dict[MessageId, str], set[MessageId]]:
        """Produce `batch` and wait for every report: the ids refused (with the reason) and,
        among them, those the broker refused with a batch-wide error. An outage raises."""
        rejected: dict[MessageId, str] = {}
        batch_wide: set[MessageId] = set()
        retryable: list[str] = []
        delivered = 0
        broken = False

        def report(outbox_id: MessageId, err: Any, _msg: Any) -> None:
            nonlocal delivered, broken
            if err is None:
                delivered += 1
            elif is_permanent(err):
                name = str(err.name())
                rejected[outbox_id] = f"kafka {name}: {err.str()}"
                if name in BATCH_WIDE_CODES:
                    batch_wide.add(outbox_id)
            else:
                retryable.append(f"{err.name()}: {err.str()}")
                broken = broken or bool(err.fatal()) or err.name() == FENCED

        refused_before = self._produce_all(batch, report, rejected)
        remaining = self.producer.flush(max(0.0, deadline - time.monotonic()))
        # A refusal by the broker leaves a gap in the idempotent producer's sequence numbers.
        self._replace_producer_if(broken or (not remaining and len(rejected) > refused_before))
        if remaining or retryable:
            detail = (
                retryable[0] if retryable else f"{remaining} message(s) not acknowledged in time"
            )
            raise SinkUnavailable(self.name, detail)
        if delivered + len(rejected) != len(batch):
            missing = len(batch) - delivered - len(rejected)
            raise SinkUnavailable(self.name, f"{missing} delivery report(s) missing")
        return rejected, batch_wide

    def _replace_producer_if(self, needed: bool) -> None:
        """A fresh producer (new producer id, sequence from 0) for the next round; what the old
        one still holds is dropped — its batch is re-sent or has been reported."""
        if needed:
            old, self.producer = self.producer, self._new_producer()
            old.purge()

    def _produce_all(
        self, batch: Sequence[Message], report: Any, rejected: dict[MessageId, str]
    ) -> int:
        """Queue every message of `batch`; the ones refused before queuing go to `rejected`
        (their number is returned) and get no report."""
        produce, raw, limit = self.producer.produce, self.envelope is Envelope.raw, self.limit
        refused = 0
        for message in batch:
            if raw:  # the hot path: no envelope to build; the client takes headers as a dict
                payload = message.payload
                value = payload.encode() if isinstance(payload, str) else payload
                headers: Any = message.headers()
            else:
                try:
                    value, headers = self._body_and_headers(message)
                except NotSent as exc:
                    rejected[message.id] = str(exc)
                    refused += 1
                    continue
            if limit is not None and len(value) > limit:
                rejected[message.id] = too_large(len(value), limit, self.config, "kafka")
                refused += 1
                continue
            while True:
                try:
                    produce(
                        self.topic,
                        value=value,
                        key=message.key.encode() if message.key is not None else None,
                        headers=headers,
                        # The id rides with the callback: a failed report may come back
                        # without the headers it was sent with (INVALID_RECORD).
                        on_delivery=partial(report, message.id),
                    )
                    break
                except BufferError:  # local queue full: let deliveries drain first
                    self.producer.poll(0.05)
                except self._kafka.KafkaException as exc:  # refused before it was queued
                    error = exc.args[0]
                    if not is_permanent(error):
                        self._replace_producer_if(bool(error.fatal()))
                        raise SinkUnavailable(self.name, f"{error.name()}: {error.str()}") from None
                    rejected[message.id] = f"kafka {error.name()}: {error.str()}"
                    refused += 1
                    break
        return refused

    def close(self) -> None:
        self.producer.flush(1.0)
