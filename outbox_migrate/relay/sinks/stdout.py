"""The stdout sink: one JSON object per message and line, written and flushed. The only core
module that writes to stdout — that is its job."""

from __future__ import annotations

import operator
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TextIO

from outbox_migrate.errors import MessagesRejected, SinkUnavailable
from outbox_migrate.relay.message import Message, MessageId
from outbox_migrate.relay.sinks import SinkConfig, check_options, size_over, too_large
from outbox_migrate.relay.sinks.envelopes import CloudEvents, Envelope, envelope_option

NOT_TEXT = "stdout: payload is not text (non-UTF-8 bytes): it cannot be written as a line"

_PAYLOAD = operator.attrgetter("payload")
_WRITE_LOCK = threading.Lock()  # shared by every worker's sink: lines never interleave


class StdoutSink:
    name = "stdout"

    def __init__(self, config: SinkConfig | None = None, stream: TextIO | None = None) -> None:
        self._stream = stream
        self.config = config or SinkConfig()
        extra = self.config.extra
        check_options(self.name, extra, ())
        envelope = envelope_option(extra, self.name, Envelope.json)
        # Bound per message (a text id's subclass quotes its id), without a Python frame.
        self._line: Callable[[Message], str] = operator.methodcaller("envelope")
        if envelope is Envelope.cloudevents:
            self._line = CloudEvents(extra).structured
        elif envelope is Envelope.raw:
            self._line = _payload

    def publish(self, batch: Sequence[Message]) -> None:
        limit = self.config.max_message_bytes
        if limit is None and bytes not in set(map(type, map(_PAYLOAD, batch))):
            # Every line can be written: no Python per message beyond the line itself.
            self._write("\n".join(map(self._line, batch)) + "\n" if batch else "")
            return
        rejected: dict[MessageId, str] = {}
        lines: list[str] = []
        for message in batch:
            if isinstance(message.payload, bytes):
                rejected[message.id] = NOT_TEXT
                continue
            line = self._line(message)
            if limit is not None and (size := size_over(line, limit)) is not None:
                rejected[message.id] = f"stdout {too_large(size, limit, self.config, 'stdout')}"
                continue
            lines.append(line)
        self._write("\n".join(lines) + "\n" if lines else "")
        if rejected:
            raise MessagesRejected(self.name, rejected)

    def _write(self, text: str) -> None:
        stream = self._stream or sys.stdout
        try:
            with _WRITE_LOCK:
                stream.write(text)
                stream.flush()
        except (OSError, ValueError) as exc:  # closed pipe or closed file
            raise SinkUnavailable(self.name, str(exc)) from None

    def close(self) -> None:
        return None


def _payload(message: Message) -> str:
    payload: str | bytes = message.payload
    if isinstance(payload, bytes):  # `publish` rejects these before: never written as b'…'
        raise TypeError(NOT_TEXT)
    return payload
