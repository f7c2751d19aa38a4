"""Message size limits: a body larger than the broker takes is rejected before it is sent.

Such a message can never be delivered, and sending it costs more than a refusal: RabbitMQ
closes the channel, Redis resets the connection (both without naming the message), a Kafka
broker refuses the whole record batch. So a sink checks each body against the limit it knows
and reports the ones over it in `MessagesRejected` (→ attempts → dead-letter table) without
sending them. The limit is the relay's `--max-message-bytes` when given, else the broker's
usual one (`USUAL_LIMIT_BYTES`); a sink that learns the broker's real limit (NATS's
`max_payload`, Redis's `proto-max-bulk-len`, a RabbitMQ channel close) uses the smaller. Pure
functions; no I/O.
"""

from __future__ import annotations

from outbox_migrate.relay.sinks import SinkConfig

MIB = 1024 * 1024
USUAL_LIMIT_BYTES: dict[str, int] = {
    "rabbitmq": 128 * MIB,
    "redis": 512 * MIB,
}
"""The broker's default, where the sink itself checks it when `--max-message-bytes` is not
given. RabbitMQ: the node's `max_message_size` on 3.8-3.13 (4.x: 16 MiB, learned from the
first channel close); Redis: `proto-max-bulk-len` (the sink reads the server's value where
CONFIG GET is allowed). Kafka and NATS need no entry: their client libraries check the limit
before sending (librdkafka its `message.max.bytes`, 1,000,000 by default; nats-py the
`max_payload` the server announces, 1 MiB by default). HTTP and stdout have none."""


def max_bytes(config: SinkConfig, sink: str) -> int | None:
    """The limit a sink checks bodies against: `--max-message-bytes`, else the usual one."""
    if config.max_message_bytes is not None:
        return config.max_message_bytes
    return USUAL_LIMIT_BYTES.get(sink)


def smaller(limit: int | None, learned: int | None) -> int | None:
    """The stricter of two limits (None = no limit)."""
    if limit is None:
        return learned
    return limit if learned is None else min(limit, learned)


def text_size_over(text: str, limit: int) -> int | None:
    """The UTF-8 size of `text` when it is over `limit`, else None.

    A character is at most 4 bytes in UTF-8, so most texts are judged from their length
    without encoding them (the check runs per message in the hot loop)."""
    if len(text) * 4 <= limit:
        return None
    size = len(text.encode())
    return size if size > limit else None


def too_large(size: int, limit: int, config: SinkConfig, what: str) -> str:
    """The rejection reason: the sizes and where the limit came from."""
    source = (
        "--max-message-bytes"
        if config.max_message_bytes is not None and limit == config.max_message_bytes
        else what
    )
    return f"message too large: {size} bytes over the limit of {limit} ({source}); not sent"
