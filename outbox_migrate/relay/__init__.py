"""The relay: claim → publish → mark, from the flat or the partitioned outbox to a broker.

At-least-once: a row is marked published only after the sink confirmed the broker accepted
it. The library entry point is `Relay`; the CLI (`outbox-migrate relay`) is a thin shell over
it. Importing this package is cheap (no psycopg, no broker client) so `--help` stays light.
"""

from __future__ import annotations

from outbox_migrate.errors import MessagesRejected, RelayError, SinkError, SinkUnavailable
from outbox_migrate.relay.message import Message
from outbox_migrate.relay.options import Mode, Ordering, RelayOptions, SwitchGate

__all__ = [
    "Message",
    "MessagesRejected",
    "Mode",
    "Ordering",
    "RelayError",
    "RelayOptions",
    "SinkError",
    "SinkUnavailable",
    "SwitchGate",
]
