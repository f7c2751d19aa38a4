"""A sink that kills its own process (SIGKILL: nothing runs after it) when a batch holds a
message whose payload has a "poison" key, and acknowledges everything else.

Loaded by the relay CLI as `--sink tests.integration.relay.cdc.killing_sink:KillOnPoison`:
it stands for a message that makes a broker library's C code crash the interpreter.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence

from outbox_migrate.relay.message import Message
from outbox_migrate.relay.sinks import SinkConfig


class KillOnPoison:
    name = "kill-on-poison"

    def __init__(self, config: SinkConfig) -> None:
        self.config = config

    def publish(self, batch: Sequence[Message]) -> None:
        if any('"poison"' in m.payload for m in batch):
            os.kill(os.getpid(), signal.SIGKILL)

    def close(self) -> None:
        return None
