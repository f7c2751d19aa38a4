"""RabbitMQ sink (pika, AMQP 0-9-1) with publisher confirms.

The channel is in confirm mode, so `basic_publish` returns only after the broker confirmed
(persisted, for a durable queue and delivery_mode 2) the message, and raises when it was
nacked or — published `mandatory` — could not be routed. Default exchange with the queue as
routing key unless `extra["exchange"]` is given; the queue (`target`) is declared durable.
Properties: message_id = outbox id (consumers de-duplicate on it), type = event type.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from outbox_migrate.dsn import mask
from outbox_migrate.relay.errors import MessagesRejected, RelayError, SinkUnavailable
from outbox_migrate.relay.message import Message
from outbox_migrate.relay.sinks import SinkConfig

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"


class RabbitMQSink:
    name = "rabbitmq"

    def __init__(self, config: SinkConfig) -> None:
        try:
            import pika
        except ImportError:
            raise RelayError(
                "the rabbitmq sink needs pika: install outbox-migrate[rabbitmq]"
            ) from None
        self._pika = pika
        self.config = config
        self.exchange = config.extra.get("exchange", "")
        self.routing_key = config.target
        self._connection: Any = None
        self._channel: Any = None

    def _open(self) -> Any:
        if self._channel is not None and self._channel.is_open:
            return self._channel
        pika = self._pika
        params = pika.URLParameters(self.config.url or DEFAULT_URL)
        params.socket_timeout = self.config.timeout_s
        params.blocked_connection_timeout = self.config.timeout_s
        params.connection_attempts = 1
        self._connection = pika.BlockingConnection(params)
        channel = self._connection.channel()
        channel.confirm_delivery()
        if not self.exchange:
            channel.queue_declare(queue=self.routing_key, durable=True)
        self._channel = channel
        return channel

    def publish(self, batch: Sequence[Message]) -> None:
        pika = self._pika
        rejected: dict[int, str] = {}
        try:
            channel = self._open()
            for message in batch:
                properties = pika.BasicProperties(
                    message_id=str(message.id),
                    type=message.event_type,
                    content_type="application/json",
                    delivery_mode=2,
                    headers=message.headers(),
                )
                try:
                    channel.basic_publish(
                        exchange=self.exchange,
                        routing_key=self.routing_key,
                        body=message.payload_bytes,
                        properties=properties,
                        mandatory=True,
                    )
                except pika.exceptions.UnroutableError:
                    rejected[message.id] = "unroutable"
        except pika.exceptions.NackError as exc:
            self.close()
            raise SinkUnavailable(self.name, f"broker nacked: {exc}") from None
        except (pika.exceptions.AMQPError, OSError) as exc:
            self.close()
            raise SinkUnavailable(self.name, mask(repr(exc))) from None
        if rejected:
            raise MessagesRejected(self.name, rejected)

    def close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and connection.is_open:
            try:
                connection.close()
            except Exception:  # noqa: BLE001 - the connection is being replaced anyway
                return
