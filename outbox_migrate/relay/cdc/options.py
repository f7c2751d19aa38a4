"""What a CDC relay run is asked to do. Pure data, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from outbox_migrate.relay.cdc.slot import check_name
from outbox_migrate.relay.errors import RelayError

DEFAULT_SLOT = "outbox_migrate_cdc"
DEFAULT_PUBLICATION = "outbox_migrate_cdc"
DEFAULT_BATCH_SIZE = 500
IDLE_TICK_S = 0.5
"""How long the stream loop waits for a frame before doing idle work (status updates)."""
STATUS_INTERVAL_S = 1.0
"""While idle, how often the relay asks the server where it is (a status update with a reply
requested): the keepalive that answers carries the position to confirm, so the slot follows
the server even when only other tables are written."""
IDLE_CONFIRM_S = 0.5
"""With nothing of the outbox in flight, the server's position is confirmed at most this often
(the slot follows it; a reply the server asks for is sent at once)."""
DEFAULT_MARK_INTERVAL_S = 0.1
DEFAULT_LINGER_S = 0.002
"""CDC's `--linger-ms` default (the polling relay's is 5 ms): chosen by `bench/cdc.py`
(docs/relay.md, "CDC mode: linger")."""
LINGER_MAX_S = 1.0
MARK_MAX_IDS = 10_000
"""A mark is sent early once this many acknowledged ids wait; with this many waiting behind a
mark still in flight, the stream waits for that mark (bounds the statement and the window a
crash re-sends)."""
LAG_WARN_BYTES = 1 << 30
LAG_WARN_S = 300.0


@dataclass(frozen=True)
class CdcOptions:
    """Options of one `relay --mode cdc` run."""

    slot: str = DEFAULT_SLOT
    publication: str = DEFAULT_PUBLICATION
    batch_size: int = DEFAULT_BATCH_SIZE
    """Most messages per publish; a batch always holds whole transactions (so one large
    transaction is published as one batch, whatever its size)."""
    mark: bool = True
    """Move delivered rows to the published partition behind the stream (one UPDATE per
    mark interval). Off: the outbox is append-only and retention drops or truncates partitions."""
    mark_interval_s: float = DEFAULT_MARK_INTERVAL_S
    """Acknowledged ids collect for this long, then go out as one mark sent without waiting
    (behind the stream: delivery never waits for it); the slot is confirmed once the mark
    committed. A SIGKILL re-sends what was acknowledged since the last mark was sent (plus
    the mark in flight and the batch being published). 0: the next mark is sent as soon as the
    previous one committed."""
    linger_s: float = DEFAULT_LINGER_S
    """Once a wake-up finds a transaction to publish (or one begun), sleep until this long
    after its first frame arrived, then read everything the socket holds and publish the
    complete transactions as one batch: fewer wake-ups (each costs a Python process ~20 µs of
    CPU) for at most this much latency. A full batch never waits; 0: publish as soon as
    nothing more is buffered."""
    failover: bool = True
    """Create the slot as a failover slot where the server supports it (PostgreSQL 17+)."""
    until_caught_up: bool = False
    """Exit once everything committed before the start has been published (tests, hand-off)."""
    lag_warn_bytes: int = LAG_WARN_BYTES
    lag_warn_s: float = LAG_WARN_S
    max_attempts: int = 5
    dead_letter_table: str = "outbox_dead_letter"
    key_column: str | None = None
    event_type_column: str | None = None
    backoff_base_s: float = 0.1
    backoff_cap_s: float = 8.0
    """The longest pause between tries of a broker that is down (and of a rejected message):
    publishing resumes at most this long after the broker returns, so a short up-window
    between outages is not slept through."""

    def __post_init__(self) -> None:
        check_name("slot", self.slot)
        check_name("publication", self.publication)
        if self.batch_size < 1:
            raise RelayError(f"batch size must be >= 1, got {self.batch_size}")
        if self.mark_interval_s < 0:
            raise RelayError("the mark interval cannot be negative")
        if not 0 <= self.linger_s <= LINGER_MAX_S:
            raise RelayError(f"linger must be 0..{LINGER_MAX_S:g} seconds, got {self.linger_s}")
        if self.max_attempts < 1:
            raise RelayError(f"max attempts must be >= 1, got {self.max_attempts}")
        if self.lag_warn_bytes < 1 or self.lag_warn_s <= 0:
            raise RelayError("slot lag warning thresholds must be positive")
