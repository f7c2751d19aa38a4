"""The switching rule: when the relay may stop publishing from the flat table, exactly once.

The spec's sketch switches at the first empty batch. That strands rows: during a rolling
deploy a V1 instance still inserts into the flat table after it was first seen empty, and
nothing would ever publish them. The rule here:

    switch when, inside one transaction holding LOCK TABLE flat IN SHARE MODE,
    (1) no writer can insert any more (the gate), and (2) no unpublished row remains.

Why it is sound: an INSERT holds ROW EXCLUSIVE on the table until its transaction ends, and
SHARE conflicts with it, so once the lock is granted every transaction that ever inserted
has committed or rolled back — (2) then sees all their rows. The gate makes sure no *later*
transaction can insert:

* `privilege` (default): no login role that a REVOKE can stop holds INSERT on the table.
  PostgreSQL enforces it; an INSERT that queued behind our lock re-reads privileges after
  acquiring its lock and fails. The operator's signal is `REVOKE INSERT ON outbox FROM app_v1`
  (as the table's owner) once V1 is gone. Superusers, the owner and members of the owner role
  insert whatever is revoked: while a session of theirs (other than the tool's own) is
  connected the privilege proves nothing, and the gate waits instead for the old version's
  sessions to be gone and the table's insert counter to stand still (relay/switch_evidence.py).
* `sessions`: no session whose application_name matches the old version's pattern is
  connected. This trusts the deploy: a V1 instance that reconnects later is not stopped.

Every "not yet" is logged at WARNING, at most once a minute per kind of reason, and recorded
in the checking session's `application_name` (`… waits:privilege @1764300000`: the reason's
short code and when, `SWITCH_WAITS`), which every role can read in pg_stat_activity: that is
how `status --watch` shows why a switching relay waits. Sessions that stop checking (the relay
switched) leave a mark that ages; the watch shows only recent ones.

Both conditions only ever move from false to true during a migration, so once switched the
relay never needs to look back; a restarted relay re-proves the rule and switches at once.
The lock is taken with a short lock_timeout so V1 writers never queue behind us for long.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from outbox_migrate.config import OutboxSpec
from outbox_migrate.errors import grant_to_see
from outbox_migrate.relay import queries
from outbox_migrate.relay.options import Mode, SwitchGate
from outbox_migrate.relay.switch_evidence import QuietWindow, Session, bypassing_sessions

log = logging.getLogger("outbox_migrate.relay")

SWITCH_LOCK_TIMEOUT_MS = 100
MAX_SESSIONS_NAMED = 5
"""How many bypassing sessions a reason names (the rest are counted)."""

SWITCH_WAITS = " waits:"
"""Marks a relay session's application_name while its switch check says "not yet"."""
WAIT_CODES = {
    "insert-privilege": "privilege",
    "bypassing-sessions": "bypass",
    "bypassing-sessions+old-sessions": "bypass+old",
    "bypassing-sessions+quiet": "bypass+quiet",
    "old-sessions": "old-sessions",
    "unpublished": "unpublished",
    "writing": "writing",
}
"""Short codes of the reasons (application_name holds 63 bytes; the tool's prefix must stay)."""
MAX_APPLICATION_NAME = 63

NotYet = tuple[str, str]
"""(kind, reason) of a gate that does not hold yet; ("", "") when it holds. The kind is the
stable key the WARNING is rate-limited by; the reason is the text for the operator."""
HOLDS: NotYet = ("", "")


def writers_remaining(
    conn: Any,
    source: queries.Source,
    gate: SwitchGate,
    old_app: str,
    quiet: QuietWindow | None = None,
) -> NotYet:
    """Who can still insert into `source`, and what to do about it (HOLDS when nobody can)."""
    if gate is SwitchGate.sessions:
        return _old_sessions(conn, old_app)
    relation = _regclass(source)
    rows = conn.execute(queries.roles_that_can_insert(), {"relation": relation}).fetchall()
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
    quiet: QuietWindow | None,
) -> NotYet:
    """Sessions a REVOKE cannot stop are connected: wait for the old version's sessions to be
    gone and the table to stay quiet (without `old_app`, for those sessions to go)."""
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
        role = _current_role(conn)
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
    still = quiet.not_quiet(conn, _regclass(source)) if quiet is not None else ""
    if still:
        return ("bypassing-sessions+quiet", f"{nothing}; the old version is gone, waiting: {still}")
    return HOLDS


def _current_role(conn: Any) -> str:
    row = conn.execute("SELECT current_user").fetchone()
    return str(row[0]) if row else "this role"


def _old_sessions(conn: Any, old_app: str) -> NotYet:
    row = conn.execute(queries.old_app_sessions(), {"pattern": old_app}).fetchone()
    count = int(row[0]) if row else 0
    if not count:
        return HOLDS
    return ("old-sessions", f"{count} session(s) of {old_app!r} connected")


def _regclass(source: queries.Source) -> str:
    """Text that `::regclass` resolves to exactly this relation (quoted identifiers)."""

    def quote(name: str) -> str:
        return '"' + name.replace('"', '""') + '"'

    return f"{quote(source.schema)}.{quote(source.mark_table)}"


def check_switch(
    conn: Any,
    source: queries.Source,
    gate: SwitchGate,
    old_app: str,
    quiet: QuietWindow | None = None,
) -> NotYet:
    """Why the relay may not leave `source` yet (HOLDS = it may). `conn` is autocommit."""

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

    # One attempt (budget 0) through the tool's lock-budget primitive: the relay tries again
    # after its next empty claim, so it never waits here, and never watches a holder.
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
    switch check runs after every empty claim, many times a second when idle, and each "not
    yet" deserves one WARNING an operator can act on, not a flood of them."""

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
    """Which table the relay's workers claim from; in switching mode it changes once."""

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
        self.switched_at: float | None = None
        self.quiet = QuietWindow()
        self.warn = RateLimitedLog(log)

    def resolve(self, resolve: Callable[[queries.Source], queries.Source]) -> None:
        """Replace both sources by `resolve`d copies (relay/marker_source.py), keeping which
        one is current; only before any worker starts."""
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
        """After an empty claim on the flat table: switch if the rule holds. True = switched."""
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
            self.switched_at = time.time()
            log.info("relay.switched from=%s to=%s", self.flat.label, self.partitioned.label)
            return True


def mark_waiting(conn: Any, kind: str) -> None:
    """Record in the session's application_name why the switch waits (`kind`), with the time;
    an empty `kind` removes the mark. The tool's prefix is kept (its sessions are known by it),
    the rest of the name is cut to make room."""
    code = WAIT_CODES.get(kind, kind)[:16]
    conn.execute(
        "SELECT set_config('application_name', CASE WHEN %(code)s = '' THEN base ELSE "
        "left(base, %(room)s - length(suffix)) || suffix END, false) FROM ("
        "SELECT split_part(current_setting('application_name'), %(marker)s, 1) AS base, "
        "%(marker)s || %(code)s || ' @' || extract(epoch FROM now())::bigint AS suffix) m",
        {"code": code, "marker": SWITCH_WAITS, "room": MAX_APPLICATION_NAME},
    )
