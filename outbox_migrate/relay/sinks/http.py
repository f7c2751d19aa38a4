"""HTTP webhook sink: one POST per message, with timeouts and retries.

Body: the message envelope (JSON); headers: `Idempotency-Key` and `X-Outbox-Id` = outbox id,
`X-Event-Type`. Any 2xx is an acknowledgement. Connection errors, timeouts, 408, 429 and 5xx
are retried `extra["retries"]` times (default 3) with backoff, then the whole batch is
`SinkUnavailable`; any other 4xx is a permanent refusal of that message (`MessagesRejected`,
which leads to the dead-letter table after the relay's max attempts).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from outbox_migrate.dsn import mask
from outbox_migrate.relay.backoff import backoff_s
from outbox_migrate.relay.errors import MessagesRejected, RelayError, SinkUnavailable
from outbox_migrate.relay.message import Message
from outbox_migrate.relay.sinks import SinkConfig

RETRYABLE_STATUS = frozenset({408, 429})
DEFAULT_RETRIES = 3
RETRY_BASE_S = 0.1


class HttpSink:
    name = "http"

    def __init__(self, config: SinkConfig) -> None:
        try:
            import httpx
        except ImportError:
            raise RelayError("the http sink needs httpx: install outbox-migrate[http]") from None
        if not config.url:
            raise RelayError("the http sink needs --sink-url (the webhook address)")
        self._httpx = httpx
        self.url = config.url
        self.retries = int(config.extra.get("retries", DEFAULT_RETRIES))
        self.client: Any = httpx.Client(timeout=config.timeout_s)

    def _post(self, message: Message) -> int:
        """POST with retries; returns the final status, raises SinkUnavailable when exhausted."""
        headers = {
            "Content-Type": "application/json",
            "Idempotency-Key": str(message.id),
            "X-Outbox-Id": str(message.id),
            "X-Event-Type": message.event_type or "",
        }
        reason = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(backoff_s(attempt - 1, base_s=RETRY_BASE_S))
            try:
                response = self.client.post(self.url, content=message.envelope(), headers=headers)
            except self._httpx.HTTPError as exc:
                reason = f"{type(exc).__name__}: {exc}"
                continue
            status = int(response.status_code)
            if status < 300:
                return status
            if status >= 500 or status in RETRYABLE_STATUS:
                reason = f"HTTP {status}"
                continue
            return status
        raise SinkUnavailable(self.name, mask(f"{reason} after {self.retries + 1} attempts"))

    def publish(self, batch: Sequence[Message]) -> None:
        rejected: dict[int, str] = {}
        for message in batch:
            status = self._post(message)
            if status >= 300:
                rejected[message.id] = f"HTTP {status}"
        if rejected:
            raise MessagesRejected(self.name, rejected)

    def close(self) -> None:
        self.client.close()
