"""NATS JetStream sink: `Nats-Msg-Id` = outbox id, so the broker drops re-sent duplicates.

JetStream acknowledges each publish once the message is stored in the stream; a message whose
id it saw within the stream's duplicate window is acknowledged as a duplicate and not stored
again — the relay's at-least-once becomes effectively-once downstream. nats-py is asyncio;
each sink owns a private event loop driven from its worker thread. Subject: `target`; the
stream (`extra["stream"]`, default derived from the subject) is created when missing.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from typing import Any

from outbox_migrate.dsn import mask
from outbox_migrate.relay.errors import RelayError, SinkUnavailable
from outbox_migrate.relay.message import Message
from outbox_migrate.relay.sinks import SinkConfig

DEFAULT_URL = "nats://127.0.0.1:4222"


def stream_name(subject: str) -> str:
    """A valid stream name for a subject (no dots, wildcards or spaces)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", subject).upper()


class NatsSink:
    name = "nats"

    def __init__(self, config: SinkConfig) -> None:
        try:
            import nats  # noqa: F401 - fail early with a clear message
        except ImportError:
            raise RelayError("the nats sink needs nats-py: install outbox-migrate[nats]") from None
        self.config = config
        self.subject = config.target
        self.stream = config.extra.get("stream") or stream_name(config.target)
        self._loop = asyncio.new_event_loop()
        self._nc: Any = None
        self._js: Any = None
        self.duplicates = 0
        """Messages JetStream acknowledged as already stored (re-sent after a crash)."""

    async def _connect(self) -> Any:
        if self._js is not None and self._nc is not None and self._nc.is_connected:
            return self._js
        import nats
        from nats.js.errors import NotFoundError

        self._nc = await nats.connect(
            self.config.url or DEFAULT_URL,
            connect_timeout=self.config.timeout_s,
            max_reconnect_attempts=0,
            allow_reconnect=False,
        )
        js = self._nc.jetstream(timeout=self.config.timeout_s)
        try:
            await js.stream_info(self.stream)
        except NotFoundError:
            await js.add_stream(name=self.stream, subjects=[self.subject])
        self._js = js
        return js

    async def _publish(self, batch: Sequence[Message]) -> list[Any]:
        js = await self._connect()
        pending = [
            js.publish(
                self.subject,
                message.payload_bytes,
                headers={"Nats-Msg-Id": str(message.id), **message.headers()},
            )
            for message in batch
        ]
        return list(await asyncio.gather(*pending))

    def publish(self, batch: Sequence[Message]) -> None:
        try:
            acks = self._loop.run_until_complete(self._publish(batch))
        except Exception as exc:  # noqa: BLE001 - nats-py raises many types; all mean "not acked"
            self._disconnect()
            raise SinkUnavailable(self.name, mask(f"{type(exc).__name__}: {exc}")) from None
        self.duplicates += sum(1 for ack in acks if getattr(ack, "duplicate", False))

    def close(self) -> None:
        self._disconnect()
        if not self._loop.is_closed():
            self._loop.close()

    def _disconnect(self) -> None:
        nc, self._nc, self._js = self._nc, None, None
        if nc is not None:
            try:
                self._loop.run_until_complete(nc.close())
            except Exception:  # noqa: BLE001 - closing a broken connection we discard anyway
                return
