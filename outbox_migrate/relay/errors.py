"""Relay errors: what a sink or the relay reports, as `OutboxMigrateError`s with facts.

`SinkUnavailable` means "nothing in this batch can be trusted as delivered; retry later with
backoff" (broker down, timeout). `MessagesRejected` means "these ids were refused, the rest
were acknowledged": the relay marks the acknowledged ones and counts attempts for the others.
"""

from __future__ import annotations

from collections.abc import Mapping

from outbox_migrate.errors import ExitCode, OutboxMigrateError
from outbox_migrate.relay.message import MessageId


class RelayError(OutboxMigrateError):
    """The relay cannot run as configured (bad sink options, missing table or column)."""

    exit_code = ExitCode.USAGE


class SinkError(OutboxMigrateError):
    """Base class for failures reported by a sink."""

    exit_code = ExitCode.FAILED


class SinkUnavailable(SinkError):
    """The broker did not acknowledge the batch; no message of it may be marked published."""

    def __init__(self, sink: str, reason: str) -> None:
        self.sink = sink
        self.reason = reason
        super().__init__(f"sink {sink} unavailable: {reason}")


class MessagesRejected(SinkError):
    """Some messages were refused (permanently or not); every other one was acknowledged."""

    def __init__(self, sink: str, rejected: Mapping[MessageId, str]) -> None:
        self.sink = sink
        self.rejected = dict(rejected)
        first = next(iter(self.rejected.items()), (0, ""))
        super().__init__(
            f"sink {sink} rejected {len(self.rejected)} message(s), e.g. id {first[0]}: {first[1]}"
        )
