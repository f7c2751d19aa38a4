"""Redis Streams sink: one XADD per message, pipelined per batch.

Acknowledged = Redis replied with the entry id for every XADD of the batch. Redis answers
from memory; whether the entry survives a Redis crash depends on its own persistence
(`appendonly yes` + `appendfsync always` for the strictest). Fields: id, table, event_type,
key, created_at, payload. The stream key is `SinkConfig.target`; `extra["maxlen"]` caps it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from outbox_migrate.dsn import mask
from outbox_migrate.relay.errors import RelayError, SinkUnavailable
from outbox_migrate.relay.message import Message
from outbox_migrate.relay.sinks import SinkConfig

DEFAULT_URL = "redis://127.0.0.1:6379/0"


class RedisSink:
    name = "redis"

    def __init__(self, config: SinkConfig) -> None:
        try:
            import redis
        except ImportError:
            raise RelayError(
                "the redis sink needs redis-py: install outbox-migrate[redis]"
            ) from None
        self._redis = redis
        self.stream = config.target
        self.maxlen = int(config.extra["maxlen"]) if "maxlen" in config.extra else None
        self.client: Any = redis.Redis.from_url(
            config.url or DEFAULT_URL,
            socket_timeout=config.timeout_s,
            socket_connect_timeout=config.timeout_s,
        )

    def publish(self, batch: Sequence[Message]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for message in batch:
            fields = {
                "id": message.id,
                "table": message.table,
                "event_type": message.event_type or "",
                "key": message.key or "",
                "created_at": message.created_at.isoformat(),
                "payload": message.payload,
            }
            pipe.xadd(self.stream, fields, maxlen=self.maxlen, approximate=True)
        try:
            replies = pipe.execute(raise_on_error=True)
        except self._redis.RedisError as exc:
            raise SinkUnavailable(self.name, mask(str(exc))) from None
        if len(replies) != len(batch) or not all(replies):
            raise SinkUnavailable(self.name, "not every XADD returned an entry id")

    def close(self) -> None:
        self.client.close()
