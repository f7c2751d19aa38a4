"""The switching rule: when the relay may leave the flat table, exactly once and for good
(docs/relay.md, "The switching rule"). It writes nothing but its session's application_name.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from outbox_migrate import sql as named
from outbox_migrate.config import OutboxSpec
from outbox_migrate.db import APPLICATION_NAME
from outbox_migrate.errors import grant_to_see
from outbox_migrate.relay import queries
from outbox_migrate.relay.options import Mode, SwitchGate

log = logging.getLogger("outbox_migrate.relay")

SWITCH_LOCK_TIMEOUT_MS = 100
MAX_SESSIONS_NAMED = 5
"""How many bypassing sessions a reason names (the rest are counted)."""

SWITCH_WAITS = " waits:"
"""Marks a relay session's application_name while its switch check says "not yet"."""
WAIT_CODES = {  # application_name holds 63 bytes, and the tool's prefix must stay
    "insert-privilege": "privilege",
    "bypassing-sessions": "bypass",
    "bypassing-sessions+old-sessions": "bypass+old",
    "bypassing-sessions+quiet": "bypass+quiet",
    "old-sessions": "old-sessions",
    "unpublished": "unpublished",
    "writing": "writing",
}
MAX_APPLICATION_NAME = 63
TOOL_SESSIONS_LIKE = APPLICATION_NAME.split("/", 1)[0] + "/%"
"""`application_name` of the tool's own sessions (runner, relay, jobs): `outbox-migrate/…`."""
QUIET_WINDOW_S = 10.0
"""How long the insert counter must stay still: well above the statistics' flush (about a
second); supporting evidence, never the only one."""

NotYet = tuple[str, str]
"""(kind: the rate-limit key, reason: for the operator); ("", "") when the gate holds."""
HOLDS: NotYet = ("", "")


@dataclass(frozen=True)
class Session:
    pid: int
    role: str
    application_name: str
    hidden: bool = False

    def describe(self) -> str:
        return f"pid {self.pid} ({self.role}, {self.application_name or 'no application_name'})"


def bypassing_sessions(conn: Any, relation: str) -> list[Session]:
    """Sessions of roles a REVOKE cannot stop (superusers, the table's owner and members of
    the owner role), counting those whose kind is hidden from us."""
    rows = conn.execute(
        named.query("switch_gate", "bypassing-sessions").compose(),
        {"relation": relation, "tool": TOOL_SESSIONS_LIKE},
    ).fetchall()
    return [Session(int(pid), str(role), str(app), bool(hidden)) for pid, role, app, hidden in rows]


class QuietWindow:
    """Whether the flat table's insert counter has stood still for `QUIET_WINDOW_S`, sampled
    at every gate check."""

    def __init__(self) -> None:
        self._count: int | None = None
        self._since = 0.0

    def not_quiet(self, conn: Any, relation: str) -> str:
        row = conn.execute(
            named.query("switch_gate", "rows-inserted").compose(), {"relation": relation}
        ).fetchone()
        count = int(row[0]) if row and row[0] is not None else 0
        now = time.monotonic()
        if count != self._count:
            self._count, self._since = count, now
        quiet = now - self._since
        if quiet >= QUIET_WINDOW_S:
            return ""
        return (
            f"the table's insert counter has been still for {quiet:.0f} s of {QUIET_WINDOW_S:g} s"
        )


def writers_remaining(
    conn: Any,
    source: queries.Source,
    gate: SwitchGate,
    old_app: str,
    quiet: QuietWindow,
) -> NotYet:
    if gate is SwitchGate.sessions:
        return _old_sessions(conn, old_app)
    relation = queries.qualified(source.schema, source.mark_table)
    rows = conn.execute(queries.named("roles-that-can-insert"), {"relation": relation}).fetchall()
    names = [str(r[0]) for r in rows]
    if names:
        return (
            "insert-privilege",
            f"roles with INSERT: {', '.join(names)}; once the old version is gone, as the "
            f"table's owner: REVOKE INSERT ON {source.label} FROM {', '.join(names)}",
        )
    bypass = bypassing_sessions(conn, relation)
    if not bypass:
        return HOLDS
    return _without_privilege_proof(conn, source, bypass, old_app, quiet)


def _without_privilege_proof(
    conn: Any,
    source: queries.Source,
    bypass: list[Session],
    old_app: str,
    quiet: QuietWindow,
) -> NotYet:
    who = ", ".join(s.describe() for s in bypass[:MAX_SESSIONS_NAMED])
    if len(bypass) > MAX_SESSIONS_NAMED:
        who += f" and {len(bypass) - MAX_SESSIONS_NAMED} more"
    nothing = (
        f"sessions of superusers or of {source.label}'s owner are connected ({who}): a REVOKE "
        "does not stop them, so the privilege gate proves nothing while they are"
    )
    hidden = sum(1 for s in bypass if s.hidden)
    if hidden:
        # Counted because their backend type is hidden: they may be background workers.
        row = conn.execute("SELECT current_user").fetchone()
        role = str(row[0]) if row else "this role"
        nothing += (
            f" ({hidden} of them hidden from {role}, which cannot tell a client from a "
            f"background worker: {grant_to_see(role)})"
        )
    if not old_app:
        return (
            "bypassing-sessions",
            f"{nothing}; the application must not write as a superuser or the table's owner: "
            "disconnect them, or give --old-app-name so the relay waits for the old "
            "version's sessions instead",
        )
    kind, why = _old_sessions(conn, old_app)
    if kind:
        return ("bypassing-sessions+old-sessions", f"{nothing}; waiting: {why}")
    relation = queries.qualified(source.schema, source.mark_table)
    still = quiet.not_quiet(conn, relation)
    if still:
        return ("bypassing-sessions+quiet", f"{nothing}; the old version is gone, waiting: {still}")
    return HOLDS


def _old_sessions(conn: Any, old_app: str) -> NotYet:
    row = conn.execute(queries.named("old-app-sessions"), {"pattern": old_app}).fetchone()
    count = int(row[0]) if row else 0
    if not count:
        return HOLDS
    return ("old-sessions", f"{count} session(s) of {old_app!r} connected")


def check_switch(
    conn: Any,
    source: queries.Source,
    gate: SwitchGate,
    old_app: str,
    quiet: QuietWindow,
) -> NotYet:
    """Why the relay may not leave `source` yet (HOLDS: it may). `conn` is autocommit."""
    from outbox_migrate.errors import LockBudgetExceeded
    from outbox_migrate.lock_budget import LockBudget, run_with_lock_budget

    blocked = writers_remaining(conn, source, gate, old_app, quiet)
    if blocked[0]:
        return blocked
    verdict = HOLDS

    def under_share_lock(c: Any) -> None:
        nonlocal verdict
        c.execute(queries.lock_for_switch(source))
        verdict = writers_remaining(c, source, gate, old_app, quiet)
        if not verdict[0]:
            row = c.execute(queries.has_unpublished(source)).fetchone()
            if row and row[0]:
                verdict = ("unpublished", "unpublished rows remain")

    # One attempt (budget 0): the relay tries again after its next empty claim.
    budget = LockBudget(lock_timeout_ms=SWITCH_LOCK_TIMEOUT_MS, budget_s=0.0)
    try:
        run_with_lock_budget(
            conn, "relay.switch", budget, under_share_lock, relations=(),
            schema=source.schema, watch_blockers=False,
        )  # fmt: skip
    except LockBudgetExceeded:
        return ("writing", "a transaction is still writing the table")
    return verdict


class RateLimitedLog:
    """`warning(key, …)` logs unless the same key was logged less than `interval_s` ago: the
    switch check runs many times a second, and each "not yet" deserves one WARNING."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict[str, float] = {}

    def warning(self, key: str, message: str, *args: object) -> bool:
        """True when it was logged."""
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            return False
        self._last[key] = now
        self.logger.warning(message, *args, stacklevel=2)
        return True


class SourceState:
    def __init__(self, spec: OutboxSpec, mode: Mode, gate: SwitchGate, old_app: str) -> None:
        self.flat = queries.flat_source(spec)
        self.partitioned = queries.partitioned_source(spec)
        self.mode = mode
        self.gate = gate
        self.old_app = old_app
        self._current = self.partitioned if mode is Mode.partitioned else self.flat
        self._lock = threading.Lock()
        self.switches = 0
        self.blocked_checks = 0
        """Times the flat table was found drained (or nearly) but the rule said "not yet"."""
        self.last_blocked_reason = ""
        self.quiet = QuietWindow()
        self.warn = RateLimitedLog(log)

    def resolve(self, resolve: Callable[[queries.Source], queries.Source]) -> None:
        flat_current = self._current is self.flat
        self.flat, self.partitioned = resolve(self.flat), resolve(self.partitioned)
        self._current = self.flat if flat_current else self.partitioned

    @property
    def current(self) -> queries.Source:
        return self._current

    @property
    def switched(self) -> bool:
        return self._current is self.partitioned

    def try_switch(self, conn: Any) -> bool:
        """After an empty claim on the flat table: switch if the rule holds. True: switched."""
        if self.mode is not Mode.switching:
            return False
        with self._lock:  # one check at a time; the first that passes switches for all
            if self.switched:
                return True
            kind, reason = check_switch(conn, self.flat, self.gate, self.old_app, self.quiet)
            mark_waiting(conn, kind)
            if kind:
                self.blocked_checks += 1
                self.warn.warning(
                    kind, "relay.switch_blocked table=%s reason=%s", self.flat.label, reason
                )
                self.last_blocked_reason = reason
                return False
            self._current = self.partitioned
            self.switches += 1
            log.info("relay.switched from=%s to=%s", self.flat.label, self.partitioned.label)
            return True


def mark_waiting(conn: Any, kind: str) -> None:
    """Record in the session's application_name, readable by every role, why the switch
    waits (empty `kind`: remove it), keeping the tool's prefix its sessions are known by."""
    code = WAIT_CODES.get(kind, kind)[:16]
    conn.execute(
        "SELECT set_config('application_name', CASE WHEN %(code)s = '' THEN base ELSE "
        "left(base, %(room)s - length(suffix)) || suffix END, false) FROM ("
        "SELECT split_part(current_setting('application_name'), %(marker)s, 1) AS base, "
        "%(marker)s || %(code)s || ' @' || extract(epoch FROM now())::bigint AS suffix) m",
        {"code": code, "marker": SWITCH_WAITS, "room": MAX_APPLICATION_NAME},
    )
