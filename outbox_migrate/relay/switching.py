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

* `privilege` (default): no non-superuser login role holds INSERT on the table. PostgreSQL
  enforces it; an INSERT that queued behind our lock re-reads privileges after acquiring its
  lock and fails. The operator's signal is `REVOKE INSERT ON outbox FROM app_v1` once V1 is
  gone (superusers bypass privileges: the application must not write as one).
* `sessions`: no session whose application_name matches the old version's pattern is
  connected. This trusts the deploy: a V1 instance that reconnects later is not stopped.

Both conditions only ever move from false to true during a migration, so once switched the
relay never needs to look back; a restarted relay re-proves the rule and switches at once.
The lock is taken with a short lock_timeout so V1 writers never queue behind us for long.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from outbox_migrate.config import OutboxSpec
from outbox_migrate.relay import queries
from outbox_migrate.relay.options import Mode, SwitchGate

log = logging.getLogger("outbox_migrate.relay")

SWITCH_LOCK_TIMEOUT_MS = 100


def writers_remaining(conn: Any, source: queries.Source, gate: SwitchGate, old_app: str) -> str:
    """Who can still insert into `source` ("" when nobody can)."""
    if gate is SwitchGate.privilege:
        rows = conn.execute(
            queries.roles_that_can_insert(), {"relation": _regclass(source)}
        ).fetchall()
        names = [str(r[0]) for r in rows]
        return f"roles with INSERT: {', '.join(names)}" if names else ""
    row = conn.execute(queries.old_app_sessions(), {"pattern": old_app}).fetchone()
    count = int(row[0]) if row else 0
    return f"{count} session(s) of {old_app!r} connected" if count else ""


def _regclass(source: queries.Source) -> str:
    """Text that `::regclass` resolves to exactly this relation (quoted identifiers)."""

    def quote(name: str) -> str:
        return '"' + name.replace('"', '""') + '"'

    return f"{quote(source.schema)}.{quote(source.mark_table)}"


def check_switch(conn: Any, source: queries.Source, gate: SwitchGate, old_app: str) -> str:
    """Why the relay may not leave `source` yet ("" = it may). `conn` is autocommit."""

    from outbox_migrate.lock_budget import LockBudget, LockBudgetExceeded, run_with_lock_budget

    blocked = writers_remaining(conn, source, gate, old_app)
    if blocked:
        return blocked
    reason = ""

    def under_share_lock(c: Any) -> None:
        nonlocal reason
        c.execute(queries.lock_for_switch(source))
        reason = writers_remaining(c, source, gate, old_app)
        if not reason:
            row = c.execute(queries.has_unpublished(source)).fetchone()
            reason = "unpublished rows remain" if row and row[0] else ""

    # One attempt (budget 0) through the tool's lock-budget primitive: the relay tries again
    # after its next empty claim, so it never waits here, and never watches a holder.
    budget = LockBudget(lock_timeout_ms=SWITCH_LOCK_TIMEOUT_MS, budget_s=0.0)
    try:
        run_with_lock_budget(
            conn, "relay.switch", budget, under_share_lock, relations=(),
            schema=source.schema, watch_blockers=False,
        )  # fmt: skip
    except LockBudgetExceeded:
        return "a transaction is still writing the table"
    return reason


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
            reason = check_switch(conn, self.flat, self.gate, self.old_app)
            if reason:
                self.blocked_checks += 1
                if reason != self.last_blocked_reason:
                    log.info("relay.switch_blocked table=%s reason=%s", self.flat.label, reason)
                self.last_blocked_reason = reason
                return False
            self._current = self.partitioned
            self.switches += 1
            self.switched_at = time.time()
            log.info("relay.switched from=%s to=%s", self.flat.label, self.partitioned.label)
            return True
