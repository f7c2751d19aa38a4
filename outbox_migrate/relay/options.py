"""What a relay run is asked to do, validated on construction: `DeliveryOptions` for both
delivery styles, `RelayOptions` for polling, `CdcOptions` for CDC. Pure data.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from outbox_migrate.backoff import backoff_s
from outbox_migrate.config import DEFAULT_CHANNEL
from outbox_migrate.errors import RelayError

DEFAULT_BATCH_SIZE = 500
MAX_BATCH_SIZE = 100_000
POLL_INTERVAL_S = 1.0
LINGER_S = 0.005
SHUTDOWN_TIMEOUT_S = 10.0
DEFAULT_SHARDS = 8
"""Default shard count (or `workers`, when more): a second relay process started with the
defaults finds shards to take instead of claiming the same rows (SQLSTATE 40001)."""
DEFAULT_DEAD_LETTER_TABLE = "outbox_dead_letter"
DEFAULT_SESSION_TIMEOUT_S = 12.0
"""The fence needs more than the 10 s sink timeout + 1 s; 12 s frees the shards within 15 s."""
SESSION_TIMEOUT_HEADROOM_S = 2.0
"""The session timeout must exceed the sink timeout by this: the fence's margin (1 s) plus
time for the claim that precedes a publish."""
ATTEMPTS_TABLE_SUFFIX = "_attempts"


class Mode(StrEnum):
    partitioned = "partitioned"
    switching = "switching"
    """Drain the flat table, then switch to the partitioned one, once."""
    flat = "flat"


class Ordering(StrEnum):
    """How the id space is split between concurrent claimers (see docs/relay.md)."""

    none = "none"  # shard by `id % shards`: order only within a shard
    key = "key"  # shard by a hash of the key: per-key order
    global_ = "global"  # one active claimer: strict id order


class SwitchGate(StrEnum):
    """The proof, besides "drained", that no writer can still insert into the flat table."""

    privilege = "privilege"  # no login role a REVOKE stops may INSERT: sound
    sessions = "sessions"  # no session of `old_app_name` connected: trusts the deploy


NAME = re.compile(r"[a-z0-9_]{1,63}\Z")
"""PostgreSQL's rule for slot names; publications too, so `publication_names` needs no quoting."""
DEFAULT_SLOT = "outbox_migrate_cdc"
DEFAULT_PUBLICATION = "outbox_migrate_cdc"
IDLE_TICK_S = 0.5
"""CDC: how long the stream loop waits for a frame before doing idle work (status updates)."""
STATUS_INTERVAL_S = 1.0
"""CDC: while idle, how often the relay asks the server for its position, so the slot
follows the server even when only other tables are written."""
IDLE_CONFIRM_S = 0.5
"""CDC: with nothing of the outbox in flight, the server's position is confirmed at most this
often (a reply the server asks for is sent at once)."""
DEFAULT_MARK_INTERVAL_S = 0.1
DEFAULT_CDC_LINGER_S = 0.002
CDC_LINGER_MAX_S = 1.0
MARK_MAX_IDS = 10_000
"""CDC: a mark goes early once this many acknowledged ids wait, and the stream waits behind a
mark in flight (bounds the statement and what a crash re-sends)."""
LAG_WARN_BYTES = 1 << 30
LAG_WARN_S = 300.0


def check_name(kind: str, name: str) -> str:
    if not NAME.match(name):
        raise RelayError(f"{kind} name {name!r}: use 1-63 lower-case letters, digits or _")
    return name


@dataclass(frozen=True)
class DeliveryOptions:
    batch_size: int = DEFAULT_BATCH_SIZE
    linger_s: float = LINGER_S
    max_attempts: int = 5
    dead_letter_table: str = DEFAULT_DEAD_LETTER_TABLE
    key_column: str | None = None
    event_type_column: str | None = None
    backoff_base_s: float = 0.1
    backoff_cap_s: float = 8.0
    """The longest pause between tries of a down broker or a rejected message, so a short
    up-window between outages is not slept through."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise RelayError(f"max attempts must be >= 1, got {self.max_attempts}")

    @property
    def attempts_table(self) -> str:
        return self.dead_letter_table + ATTEMPTS_TABLE_SUFFIX

    def backoff(self, failures: int) -> float:
        return backoff_s(failures, base_s=self.backoff_base_s, cap_s=self.backoff_cap_s)


@dataclass(frozen=True)
class RelayOptions(DeliveryOptions):
    mode: Mode = Mode.partitioned
    workers: int = 1
    shards: int | None = None
    ordering: Ordering = Ordering.none
    until_empty: bool = False
    poll_interval_s: float = POLL_INTERVAL_S
    read_ahead: bool = True
    listen: bool = True
    channel: str = DEFAULT_CHANNEL
    shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S
    switch_gate: SwitchGate = SwitchGate.privilege
    old_app_name: str = ""
    """SQL LIKE pattern of the old application's `application_name`."""
    sink_timeout_s: float = 10.0
    session_timeout_s: float | None = None
    """None: max(12 s, sink timeout + 2 s); 0: off (docs/relay.md, "Options")."""
    max_message_bytes: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.batch_size <= MAX_BATCH_SIZE:
            raise RelayError(f"batch size must be 1..{MAX_BATCH_SIZE}, got {self.batch_size}")
        if self.workers < 1:
            raise RelayError(f"workers must be >= 1, got {self.workers}")
        if self.shards is not None and self.shards < 1:
            raise RelayError(f"shards must be >= 1, got {self.shards}")
        if self.poll_interval_s <= 0 or self.shutdown_timeout_s <= 0:
            raise RelayError("poll interval and shutdown timeout must be positive")
        if self.session_timeout_s is not None and 0 < self.session_timeout_s < (
            self.sink_timeout_s + SESSION_TIMEOUT_HEADROOM_S
        ):
            raise RelayError(
                f"session timeout ({self.session_timeout_s:g} s) must exceed the sink timeout "
                f"({self.sink_timeout_s:g} s) by {SESSION_TIMEOUT_HEADROOM_S:g} s: a publish must "
                "end before the shard lease can move to another relay"
            )
        if self.max_message_bytes is not None and self.max_message_bytes < 1:
            raise RelayError(f"max message bytes must be >= 1, got {self.max_message_bytes}")
        if not 0 <= self.linger_s <= self.poll_interval_s:
            raise RelayError(f"linger must be 0..poll interval seconds, got {self.linger_s}")
        if (
            self.mode is Mode.switching
            and self.switch_gate is SwitchGate.sessions
            and not (self.old_app_name)
        ):
            raise RelayError("the sessions switch gate needs old_app_name (the V1 app's name)")

    @property
    def dead_session_s(self) -> float:
        if self.session_timeout_s is not None:
            return self.session_timeout_s
        return max(DEFAULT_SESSION_TIMEOUT_S, self.sink_timeout_s + SESSION_TIMEOUT_HEADROOM_S)

    @property
    def shard_count(self) -> int:
        if self.ordering is Ordering.global_:
            return 1
        return self.shards or max(self.workers, DEFAULT_SHARDS)


@dataclass(frozen=True)
class CdcOptions(DeliveryOptions):
    slot: str = DEFAULT_SLOT
    publication: str = DEFAULT_PUBLICATION
    linger_s: float = DEFAULT_CDC_LINGER_S
    mark: bool = True
    mark_interval_s: float = DEFAULT_MARK_INTERVAL_S
    """0: the next mark as soon as the previous one committed (docs/relay.md, "CDC mode")."""
    failover: bool = True
    until_caught_up: bool = False
    lag_warn_bytes: int = LAG_WARN_BYTES
    lag_warn_s: float = LAG_WARN_S

    def __post_init__(self) -> None:
        super().__post_init__()
        check_name("slot", self.slot)
        check_name("publication", self.publication)
        if self.batch_size < 1:
            raise RelayError(f"batch size must be >= 1, got {self.batch_size}")
        if self.mark_interval_s < 0:
            raise RelayError("the mark interval cannot be negative")
        if not 0 <= self.linger_s <= CDC_LINGER_MAX_S:
            raise RelayError(f"linger must be 0..{CDC_LINGER_MAX_S:g} seconds, got {self.linger_s}")
        if self.lag_warn_bytes < 1 or self.lag_warn_s <= 0:
            raise RelayError("slot lag warning thresholds must be positive")
