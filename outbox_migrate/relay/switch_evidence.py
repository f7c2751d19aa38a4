"""What the switching relay's privilege gate needs besides "nobody holds INSERT": who can
insert whatever is revoked, and whether the old table has stayed quiet. Reads only; never waits.

A REVOKE stops every role but superusers, the table's owner and members of the owner role. A
session of one of those (other than the tool's own) could still insert into the flat table
after the switch, and its rows would be stranded: while one is connected the privilege gate
proves nothing, and the relay falls back on what does — the old version's sessions gone
(`old_app_name`, as the sessions gate) and the table's insert counter unchanged for a window.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from outbox_migrate import sql as named
from outbox_migrate.db import APPLICATION_NAME

TOOL_SESSIONS_LIKE = APPLICATION_NAME.split("/", 1)[0] + "/%"
"""`application_name` of the tool's own sessions (runner, relay, jobs): `outbox-migrate/…`."""
QUIET_WINDOW_S = 10.0
"""How long the insert counter must stay still: well above the statistics' flush (about a
second); supporting evidence, never the only one."""


@dataclass(frozen=True)
class Session:
    pid: int
    role: str
    application_name: str
    hidden: bool = False
    """Its activity is hidden from our role: it may be a background worker, or a client."""

    def describe(self) -> str:
        return f"pid {self.pid} ({self.role}, {self.application_name or 'no application_name'})"


def bypassing_sessions(conn: Any, relation: str) -> list[Session]:
    """Sessions of roles a REVOKE cannot stop (`relation`: text ::regclass resolves),
    counting those whose kind is hidden from us (`hidden`)."""
    rows = conn.execute(
        named.query("switch_gate", "bypassing-sessions").compose(),
        {"relation": relation, "tool": TOOL_SESSIONS_LIKE},
    ).fetchall()
    return [Session(int(pid), str(role), str(app), bool(hidden)) for pid, role, app, hidden in rows]


class QuietWindow:
    """Whether the flat table's insert counter has stood still for `window_s`, sampled at
    every gate check (a move is seen at the next check whenever it happened)."""

    def __init__(
        self, window_s: float | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.window_s = QUIET_WINDOW_S if window_s is None else window_s
        self.clock = clock
        self._count: int | None = None
        self._since = 0.0

    def quiet_for(self, conn: Any, relation: str) -> float:
        """Seconds the counter has not moved (0 at the first sample and after a move)."""
        row = conn.execute(
            named.query("switch_gate", "rows-inserted").compose(), {"relation": relation}
        ).fetchone()
        count = int(row[0]) if row and row[0] is not None else 0
        now = self.clock()
        if count != self._count:
            self._count, self._since = count, now
        return now - self._since

    def not_quiet(self, conn: Any, relation: str) -> str:
        """Why the window does not hold yet ("" once it does)."""
        quiet = self.quiet_for(conn, relation)
        if quiet >= self.window_s:
            return ""
        return f"the table's insert counter has been still for {quiet:.0f} s of {self.window_s:g} s"
