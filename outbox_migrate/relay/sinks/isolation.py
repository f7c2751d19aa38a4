"""Finding the one message a broker refused a whole request for: bisection within the sink's
timeout (docs/sinks.md, "Refused or too large"). No I/O here: `send` does it."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from outbox_migrate.errors import SinkUnavailable
from outbox_migrate.relay.message import Message, MessageId

SendGroup = Callable[[Sequence[Message]], Mapping[MessageId, str]]
"""Send these messages as one request; return the ids refused, with the reason. Raises
`SinkUnavailable` for an outage (then the whole publish is one)."""


def isolate(
    suspects: Sequence[Message], send: SendGroup, deadline: float, sink: str
) -> dict[MessageId, str]:
    """The messages among `suspects` — refused together already — the broker refuses on
    their own; the rest are delivered. The search starts from their halves: sending them all
    again would only repeat the refusal, and cost the round trip the timeout may lack.
    `deadline` is a `time.monotonic()` value."""
    rejected: dict[MessageId, str] = {}
    delivered: list[MessageId] = []
    half = len(suspects) // 2
    pending: list[Sequence[Message]] = [suspects[half:], suspects[:half]] if half else [suspects]
    while pending:
        if time.monotonic() >= deadline:
            left = sum(len(group) for group in pending)
            raise SinkUnavailable(
                sink,
                f"the broker refused {left} message(s) together; the refused one was not "
                "found within the sink timeout",
                acknowledged=delivered,
            )
        group = pending.pop()
        try:
            refused = send(group)
        except SinkUnavailable as exc:
            raise SinkUnavailable(sink, exc.reason, [*delivered, *exc.acknowledged]) from None
        delivered.extend(m.id for m in group if m.id not in refused)
        culprits = [message for message in group if message.id in refused]
        if len(culprits) <= 1:  # refused alone (or not at all): that verdict is its own
            rejected.update({m.id: refused[m.id] for m in culprits})
            continue
        half = len(culprits) // 2
        pending.extend((culprits[half:], culprits[:half]))  # the first half is tried first
    return rejected
