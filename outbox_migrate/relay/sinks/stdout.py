"""The stdout sink: one JSON object per message and line (id, table, event_type, key,
created_at, payload). The only core module that writes to stdout — that is its job.

"Acknowledged" means written and flushed. Workers share one lock so lines never interleave.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from typing import TextIO

from outbox_migrate.relay.errors import SinkUnavailable
from outbox_migrate.relay.message import Message
from outbox_migrate.relay.sinks import SinkConfig

_WRITE_LOCK = threading.Lock()


class StdoutSink:
    name = "stdout"

    def __init__(self, config: SinkConfig | None = None, stream: TextIO | None = None) -> None:
        self._stream = stream

    def publish(self, batch: Sequence[Message]) -> None:
        stream = self._stream or sys.stdout
        text = "\n".join(map(Message.envelope, batch)) + "\n" if batch else ""
        try:
            with _WRITE_LOCK:
                stream.write(text)
                stream.flush()
        except (OSError, ValueError) as exc:  # closed pipe or closed file
            raise SinkUnavailable(self.name, str(exc)) from None

    def close(self) -> None:
        return None
