"""The stdout sink: one JSON object per message and line. The only core module that writes to
stdout — that is its job.

The object is the relay's envelope (id, table, event_type, key, created_at, payload) by
default (`envelope=json`); `envelope=cloudevents` writes CloudEvents 1.0 structured-mode JSON
(attributes and `data`), `envelope=raw` the payload alone. Extra headers have no place in the
line for `json`/`raw`; use `cloudevents` or another sink when consumers need them.

"Acknowledged" means written and flushed. Workers share one lock so lines never interleave.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from typing import TextIO

from outbox_migrate.relay.errors import SinkUnavailable
from outbox_migrate.relay.message import Message
from outbox_migrate.relay.sinks import SinkConfig
from outbox_migrate.relay.sinks.envelopes import CloudEvents, Envelope, envelope_option

_WRITE_LOCK = threading.Lock()


class StdoutSink:
    name = "stdout"

    def __init__(self, config: SinkConfig | None = None, stream: TextIO | None = None) -> None:
        self._stream = stream
        extra = config.extra if config is not None else {}
        envelope = envelope_option(extra, self.name, Envelope.json)
        self._line: Callable[[Message], str] = Message.envelope
        if envelope is Envelope.cloudevents:
            self._line = CloudEvents(extra).structured
        elif envelope is Envelope.raw:
            self._line = _payload

    def publish(self, batch: Sequence[Message]) -> None:
        stream = self._stream or sys.stdout
        text = "\n".join(map(self._line, batch)) + "\n" if batch else ""
        try:
            with _WRITE_LOCK:
                stream.write(text)
                stream.flush()
        except (OSError, ValueError) as exc:  # closed pipe or closed file
            raise SinkUnavailable(self.name, str(exc)) from None

    def close(self) -> None:
        return None


def _payload(message: Message) -> str:
    return message.payload_text()
