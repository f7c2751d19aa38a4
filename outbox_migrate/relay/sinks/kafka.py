"""Kafka-protocol sink (confluent-kafka / librdkafka), idempotent producer, acks=all.

Every message of the batch is produced, then `flush` waits for the delivery reports; the
batch counts as acknowledged only when every report came back without error. Key: the key
column (`message_key` by default); headers: outbox id, table and event type. A flush that
times out or a delivery error is `SinkUnavailable` (the batch will be re-sent, consumers
de-duplicate on the `outbox-id` header). Bootstrap servers: `url`; topic: `target`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from outbox_migrate.relay.errors import RelayError, SinkUnavailable
from outbox_migrate.relay.message import Message
from outbox_migrate.relay.sinks import SinkConfig

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"


class KafkaSink:
    name = "kafka"

    def __init__(self, config: SinkConfig) -> None:
        try:
            import confluent_kafka
        except ImportError:
            raise RelayError(
                "the kafka sink needs confluent-kafka: install outbox-migrate[kafka]"
            ) from None
        self.config = config
        self.topic = config.target
        settings: dict[str, Any] = {
            "bootstrap.servers": config.url or DEFAULT_BOOTSTRAP,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 2,
            "message.timeout.ms": int(config.timeout_s * 1000),
            "socket.timeout.ms": int(config.timeout_s * 1000),
        }
        settings.update({k: v for k, v in config.extra.items() if "." in k})
        self.producer: Any = confluent_kafka.Producer(settings)

    def publish(self, batch: Sequence[Message]) -> None:
        errors: list[str] = []
        delivered = 0

        def report(err: Any, _msg: Any) -> None:
            nonlocal delivered
            if err is not None:
                errors.append(str(err))
            else:
                delivered += 1

        for message in batch:
            while True:
                try:
                    self.producer.produce(
                        self.topic,
                        value=message.payload_bytes,
                        key=message.key.encode() if message.key is not None else None,
                        headers=list(message.headers().items()),
                        on_delivery=report,
                    )
                    break
                except BufferError:  # local queue full: let deliveries drain first
                    self.producer.poll(0.05)
        remaining = self.producer.flush(self.config.timeout_s)
        if remaining or errors or delivered != len(batch):
            detail = errors[0] if errors else f"{remaining} message(s) not acknowledged in time"
            raise SinkUnavailable(self.name, detail)

    def close(self) -> None:
        self.producer.flush(1.0)
