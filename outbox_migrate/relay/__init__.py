"""The relay: claim → publish → mark, from the flat or the partitioned outbox to a broker.
Importing this package must stay cheap (no psycopg, no broker client) so `--help` stays light.
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
