"""Relay errors: what a sink or the relay reports, as `OutboxMigrateError`s with facts.

`SinkUnavailable` means "nothing in this batch can be trusted as delivered; retry later with
backoff" (broker down, timeout) — except the ids it names as `acknowledged`, when the sink
knows them (the HTTP sink, whose publish ran out of its time after some 2xx answers): the
relay marks those and claims the rest again, so they are not sent twice. `MessagesRejected`
means "these ids were refused, the rest were acknowledged": the relay marks the acknowledged
ones and counts attempts for the others.
`UnrepresentableMessage` means "this one message cannot be put in the form the sink sends"
(a raw bytes payload in a JSON envelope): a rejection of that message, never an outage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from outbox_migrate.errors import ExitCode, OutboxMigrateError

MessageId = int | str
"""An outbox id as the relay carries it: a database id (int), or an application id (uuid,
ULID) as text. Here, below the messages and the errors that name them."""


class RelayError(OutboxMigrateError):
    """The relay cannot run as configured (bad sink options, missing table or column)."""

    exit_code = ExitCode.USAGE


class RelayFailed(OutboxMigrateError):
    """The relay stopped on a fault met while running (exit 1): not bad input, which is
    refused before any work starts (`RelayError`, exit 2)."""

    exit_code = ExitCode.FAILED


class SinkCrashed(RelayFailed):
    """The sink raised something outside its protocol (not a `SinkError`: a serializer's bug,
    a client library's assertion) while it held the messages `ids` of source `label`. The
    relay stops (exit 1) and the attempt counts against those messages (relay/bad_rows.py
    says why), so one message that breaks a sink does not stop the outbox for ever."""

    def __init__(
        self, sink: str, label: str, ids: Sequence[MessageId], cause: BaseException
    ) -> None:
        self.label = label
        self.ids = list(ids)
        self.reason = crash_reason(cause)
        super().__init__(f"sink {sink} failed: {self.reason}")


def crash_reason(exc: BaseException) -> str:
    """How a sink's unexpected exception is kept as a message's last error."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())


class SinkError(OutboxMigrateError):
    """Base class for failures reported by a sink."""

    exit_code = ExitCode.FAILED


class SinkUnavailable(SinkError):
    """The broker did not acknowledge the batch; no message of it may be marked published."""

    def __init__(self, sink: str, reason: str, acknowledged: Sequence[MessageId] = ()) -> None:
        self.sink = sink
        self.reason = reason
        self.acknowledged = list(acknowledged)
        """Messages of the batch the broker did acknowledge before the rest failed."""
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


class UnrepresentableMessage(SinkError):
    """A message cannot be rendered the way the sink sends it: its payload is raw bytes (a
    bytea payload that is not UTF-8) and the sink needs text (a JSON envelope).

    Retrying cannot change the row, so the relay treats it as a rejection of this message
    alone (counted, then dead-lettered with `reason`); the rest of the batch flows. Raised by
    `Message.envelope()`, which fills `message_id`; a sink may raise it itself."""

    def __init__(self, reason: str, message_id: MessageId | None = None) -> None:
        self.reason = reason
        self.message_id = message_id
        where = "" if message_id is None else f" (id {message_id})"
        super().__init__(f"message cannot be represented{where}: {reason}")


class NamesMoved(RelayFailed):
    """A name the relay was started with no longer means the relation it meant then (a
    rename, or its rollback, under a running relay): its marks would reach another table's
    rows by ctid. The relay stops (exit 1) rather than publish what it can no longer mark."""


class MarkFellShort(Exception):
    """A mark changed fewer rows than the batch claimed and locked: the worker looks at its
    names (`marker_source.check_names`). Its rows stay unpublished and are claimed again."""

    def __init__(self, label: str, expected: int, changed: int) -> None:
        self.label = label
        super().__init__(f"the mark of {expected} claimed row(s) of {label} changed {changed}")
