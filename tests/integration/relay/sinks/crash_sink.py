"""A sink for the crash test: Redis, then SIGKILL of its own process after the third ack.

Loaded by the relay CLI as `--sink tests.integration.relay.sinks.crash_sink:KillAfterAck`; the kill
lands exactly between the broker's acknowledgement and the relay's mark.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence

from outbox_migrate.relay.message import Message
from outbox_migrate.relay.sinks import SinkConfig
from outbox_migrate.relay.sinks.redis import RedisSink

KILL_AFTER_BATCHES = 3


class KillAfterAck(RedisSink):
    def __init__(self, config: SinkConfig) -> None:
        super().__init__(config)
        self.batches = 0

    def publish(self, batch: Sequence[Message]) -> None:
        super().publish(batch)  # returns only once Redis acknowledged every XADD
        self.batches += 1
        if self.batches == KILL_AFTER_BATCHES:
            os.kill(os.getpid(), signal.SIGKILL)
