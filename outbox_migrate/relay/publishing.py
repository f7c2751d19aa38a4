"""One publish of a batch through a sink, with the refusals sorted per message. No waiting
here: the caller holds a transaction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from outbox_migrate.errors import MessagesRejected, UnrepresentableMessage
from outbox_migrate.relay.message import Message, MessageId
from outbox_migrate.relay.sinks import Sink

if TYPE_CHECKING:
    from outbox_migrate.relay.bad_rows import FailedMessages


def publish(
    sink: Sink, batch: Sequence[Message]
) -> tuple[dict[MessageId, str], dict[MessageId, str]]:
    """Publish `batch`; returns (rejected by the broker, unrepresentable) as id → reason.
    Every other message was acknowledged. `SinkUnavailable` propagates."""
    unrepresentable: dict[MessageId, str] = {}
    todo = batch
    while todo:
        try:
            sink.publish(todo)
            break
        except MessagesRejected as exc:
            return exc.rejected, unrepresentable
        except UnrepresentableMessage as exc:
            # Raised while the batch is rendered: nothing of it is acknowledged, so the rest
            # goes again (downstream de-duplicates on the outbox id).
            unrepresentable.update((m.id, exc.reason) for m in _culprits(todo, exc))
            todo = [m for m in todo if m.id not in unrepresentable]
    return {}, unrepresentable


def suspects_apart(
    failures: FailedMessages, label: str, batch: list[Message]
) -> list[list[Message]]:
    """`batch` as the parts to publish one after another; no work per message while no
    failure is on record."""
    if not failures.known:
        return [batch]
    seen = set(failures.seen_before(label, [m.id for m in batch]))
    return list(split_suspects(batch, seen.__contains__)) if seen else [batch]


def split_suspects(
    batch: Sequence[Message], suspect: Callable[[MessageId], bool]
) -> Iterator[list[Message]]:
    """The batch in order, each suspect alone, so a sink crash it causes again counts against
    it only; the messages between them together."""
    run: list[Message] = []
    for m in batch:
        if suspect(m.id):
            if run:
                yield run
                run = []
            yield [m]
        else:
            run.append(m)
    if run:
        yield run


def _culprits(todo: Sequence[Message], exc: UnrepresentableMessage) -> list[Message]:
    """The message the error names, or every raw payload when it named none."""
    named = [m for m in todo if m.id == exc.message_id] if exc.message_id is not None else []
    if not named and exc.message_id is None:
        named = [m for m in todo if type(m.payload) is bytes]
    if not named:
        raise exc
    return named
