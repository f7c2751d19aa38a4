"""The role check (`outbox-migrate roles`): what each role in docs/roles.md can and cannot do
and see on this database, and what each missing grant will cost. Catalog reads only, in a
read-only session: the server says what it would allow, so the check cannot disagree with what
a step or the relay meets. Relations not created yet are not checked (their grants are carried).

What the application and the relay need depends on the migration's phase (`uses`, the
phase's `AppBehaviour` from the ledger): after the switch they use the partitioned table only,
and asking for INSERT on the flat table again would undo the REVOKE the V3 gate requires.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from psycopg import Connection, sql

from outbox_migrate import sql as queries
from outbox_migrate.advisory.table_privileges import SWITCHING_PATTERNS, read_table_privileges
from outbox_migrate.config import OutboxSpec
from outbox_migrate.errors import SEE_OTHER_SESSIONS, ExitCode, OutboxMigrateError, UsageError
from outbox_migrate.patterns.kinds.dead_letter_tables import (
    ATTEMPTS_TABLE_SUFFIX,
    DEAD_LETTER_TABLE,
)
from outbox_migrate.patterns.model import AppBehaviour, Table
from outbox_migrate.relay.options import DEFAULT_PUBLICATION

LEDGER_SCHEMA = "outbox_migrate"
"""The runner's ledger schema (runner/ledger.py SCHEMA; the runner is a layer above)."""


@dataclass(frozen=True)
class Check:
    """One thing a role must be able to do or see. `ok` None: nothing to check yet (the
    relation does not exist); `cost`: what happens when it is missing; `fix`: the grant."""

    role: str
    duty: str
    what: str
    ok: bool | None
    cost: str
    fix: str


class MissingGrants(OutboxMigrateError):
    """A named role cannot do its job on this database (exit 5, a precondition)."""

    exit_code = ExitCode.PRECONDITION


def check_roles(
    conn: Connection[Any],
    spec: OutboxSpec,
    *,
    owner: str | None = None,
    apps: Sequence[str] = (),
    relays: Sequence[str] = (),
    cdc_relays: Sequence[str] = (),
    pattern: str | None = None,
    publication: str = DEFAULT_PUBLICATION,
    uses: AppBehaviour | None = None,
) -> list[Check]:
    """Every check for the roles named; unnamed ones default to the outbox's owner, the
    grantees with INSERT on the table the application inserts into (the application) and
    those with UPDATE on the one the relay publishes from (the relay).

    `uses`: what the application version of the migration's current phase inserts into and
    publishes from; None (no migration recorded, or a ledger this role cannot read): every
    outbox table that exists, as before a migration."""
    dead = (DEAD_LETTER_TABLE, DEAD_LETTER_TABLE + ATTEMPTS_TABLE_SUFFIX)
    names = (spec.table, spec.partitioned_table, spec.unpublished_partition, *dead)
    found = conn.execute(
        "SELECT c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relname = ANY(%s)",
        (spec.schema, list(names)),
    ).fetchall()
    existing = {str(r[0]) for r in found}
    outbox = next((t for t in (spec.table, spec.partitioned_table) if t in existing), None)
    if outbox is None:
        raise UsageError(f"neither {spec.schema}.{spec.table} nor "
                         f"{spec.schema}.{spec.partitioned_table} exists")  # fmt: skip
    checker = _Checker(conn, spec, existing, outbox, publication, uses)
    owner = owner or read_table_privileges(conn, OutboxSpec(schema=spec.schema,
                                                            table=outbox)).owner  # fmt: skip
    apps = list(apps) or checker.grantees("INSERT", checker.inserted)
    relays = list(relays) or checker.grantees("UPDATE", checker.claimed(flat=checker.flat))
    for role in (owner, *apps, *relays, *cdc_relays):
        checker.require_role(role)
    checks = checker.runner(owner)
    for role in apps:
        checks += checker.application(role)
    switching = pattern is None or pattern in SWITCHING_PATTERNS
    # Only V2's switching relay must see other sessions: once it has switched, none does.
    see = switching and (uses is None or uses.publishes_from is not Table.NEW)
    for role in relays:
        checks += checker.relay(role, see_sessions=see)
    for role in cdc_relays:
        checks += checker.cdc_relay(role)
    if not apps:
        checks.append(Check("-", "application", NOT_CHECKED, None,
                            f"no role but the owner has INSERT on "
                            f"{checker.listed(checker.inserted)} (the application runs as the "
                            "owner or a superuser?); name it with --app", ""))  # fmt: skip
    if not relays:
        checks.append(Check("-", "relay", NOT_CHECKED, None,
                            f"no role but the owner has UPDATE on "
                            f"{checker.listed(checker.claimed(flat=checker.flat))} (the relay "
                            "runs as the owner or a superuser?); name it with --relay",
                            ""))  # fmt: skip
    return checks


NOT_CHECKED = "not checked"
"""The `what` of a duty no role was named or found for: nothing was checked, nothing passed."""


def not_checked(checks: Iterable[Check]) -> list[str]:
    """The duties no role was checked for (`roles` says so: they must not read as a pass)."""
    return [c.duty for c in checks if c.what == NOT_CHECKED]


def missing(checks: Iterable[Check]) -> list[Check]:
    return [c for c in checks if c.ok is False]


def refusal(checks: Sequence[Check]) -> MissingGrants:
    """The one line a failed check ends with: how many are missing, and the first."""
    gaps = missing(checks)
    first = gaps[0]
    return MissingGrants(
        f"{len(gaps)} of {len(checks)} role checks fail; first: {first.role} ({first.duty}) "
        f"is missing {first.what}: {first.fix}"
    )


def as_json(checks: Sequence[Check]) -> dict[str, Any]:
    """`ok`: false when a check fails, null when none fails but a duty was not checked (no
    role named or found for it, `not_checked`), true only when every duty was checked."""
    unchecked = not_checked(checks)
    ok = False if missing(checks) else (None if unchecked else True)
    return {"ok": ok, "not_checked": unchecked, "checks": [asdict(c) for c in checks]}


class _Checker:
    def __init__(
        self,
        conn: Connection[Any],
        spec: OutboxSpec,
        existing: set[str],
        outbox: str,
        publication: str,
        uses: AppBehaviour | None = None,
    ) -> None:
        self.conn, self.spec, self.existing = conn, spec, existing
        self.outbox, self.publication = outbox, publication
        self.outbox_reg = sql.Identifier(spec.schema, outbox).as_string(conn)
        flat, new = spec.table, spec.partitioned_table
        if uses is not None and uses.renamed:  # the partitioned table has the flat one's name
            flat, new = "", spec.table
        if uses is None:
            self.inserted = [t for t in (flat, new) if t in existing] or [new]
            self.flat = flat in existing
        else:
            self.inserted = {Table.OLD: [flat], Table.NEW: [new]}.get(uses.inserts_into,
                                                                       [flat, new])  # fmt: skip
            self.flat = uses.publishes_from is not Table.NEW and flat in existing
        # `inserted`: the tables the application inserts into now; `flat`: whether the
        # relay still publishes from the flat table (before the switch).
        self.new = new

    def listed(self, relations: Sequence[str]) -> str:
        return ", ".join(f"{self.spec.schema}.{r}" for r in relations)

    def grantees(self, privilege: str, relations: Sequence[str]) -> list[str]:
        """The roles but PUBLIC granted `privilege` (on the whole table) on the first of
        `relations` that exists: the roles that play a duty unless named."""
        there = next((r for r in relations if r in self.existing), None)
        if there is None:
            return []
        held = read_table_privileges(self.conn, OutboxSpec(schema=self.spec.schema, table=there))
        # INSERT on some columns is still an application; UPDATE on some is no relay.
        return sorted({g.grantee for g in held.grants if g.grantee != "PUBLIC"
                       and g.privilege == privilege
                       and (g.column is None or privilege == "INSERT")})  # fmt: skip

    def q(self, *name: str) -> str:
        """`name` quoted as an identifier (schema-qualified when two parts)."""
        return sql.Identifier(*name).as_string(self.conn)

    def require_role(self, role: str) -> None:
        if self.conn.execute("SELECT to_regrole(%s)", (self.q(role),)
                             ).fetchone() == (None,):  # fmt: skip
            raise UsageError(f"role {role} does not exist")

    def _facts(self, role: str) -> tuple[Any, ...]:
        row = self.conn.execute(
            queries.query("privileges", "role-facts").compose(),
            {"role": role, "relation": self.outbox_reg, "ledger": LEDGER_SCHEMA},
        ).fetchone()
        assert row is not None  # the outbox exists: checked before
        return tuple(row)

    def _may(self, role: str, relation: str, privilege: str) -> bool:
        reg = self.q(self.spec.schema, relation)
        row = self.conn.execute(
            "SELECT has_table_privilege(%s::name, %s::regclass, %s)", (role, reg, privilege)
        ).fetchone()
        return bool(row and row[0])

    def _grant(self, role: str, duty: str, privileges: str, relations: Sequence[str],
               cost: str) -> Check:  # fmt: skip
        """`privileges` on each of `relations` that exists; None when none exists yet (the
        migration carries the grants when it creates them)."""
        there = [r for r in relations if r in self.existing]
        wanted = [self._may(role, r, p.strip()) for r in there for p in privileges.split(",")]
        quoted = ", ".join(self.q(self.spec.schema, r) for r in there or relations)
        what = f"{privileges} on {', '.join(there or relations)}"
        if not there:
            cost = "not created yet: the migration grants it when it creates it"
        return Check(role, duty, what, all(wanted) if there else None, cost,
                     f"GRANT {privileges} ON {quoted} TO {self.q(role)}")  # fmt: skip

    def _see(self, role: str, duty: str, sees: bool, cost: str) -> Check:
        fix = f"GRANT {SEE_OTHER_SESSIONS} TO {self.q(role)} (or pg_monitor)"
        return Check(role, duty, "sight of other roles' sessions", sees, cost, fix)

    def runner(self, role: str) -> list[Check]:
        _s, _r, sees, owns, usage, create, db_create, ledger, owner = self._facts(role)
        quoted = self.q(role)
        schema = self.spec.schema
        duty = "runner"
        return [
            Check(role, duty, f"owner of {self.outbox}", owns,
                  "the steps' DDL fails: permission denied",
                  f"run as {owner}, or GRANT {self.q(owner)} TO {quoted}"),
            Check(role, duty, f"CREATE on schema {schema}", bool(usage and create),
                  "the steps that create tables fail",
                  f"GRANT USAGE, CREATE ON SCHEMA {self.q(schema)} TO {quoted}"),
            Check(role, duty, "CREATE on the database", bool(db_create) and ledger is not False,
                  f"run, next, rollback fail at once: no ledger ({LEDGER_SCHEMA} schema)",
                  f"GRANT CREATE ON DATABASE {self.q(self.conn.info.dbname)} TO {quoted} "
                  f"(and CREATE ON SCHEMA {LEDGER_SCHEMA})"),
            self._see(role, duty, bool(sees),
                      "--on-long-tx refuse refuses, lock holders are named 'hidden'"),
        ]  # fmt: skip

    def application(self, role: str) -> list[Check]:
        return [self._grant(role, "application", "INSERT", self.inserted,
                            "its inserts fail")]  # fmt: skip

    def claimed(self, *, flat: bool) -> list[str]:
        """The tables the relay claims from: the flat one only before the switch."""
        return ([self.spec.table] if flat else []) + [self.new, self.spec.unpublished_partition]

    def _claims(self, role: str, duty: str, *, flat: bool) -> list[Check]:
        spec = self.spec
        claimed = self.claimed(flat=flat)
        dead = [DEAD_LETTER_TABLE, DEAD_LETTER_TABLE + ATTEMPTS_TABLE_SUFFIX]
        bad_row = "a bad row cannot be dead-lettered: the relay stops, the outbox with it"
        return [
            self._grant(role, duty, "SELECT, UPDATE", claimed, "cannot claim or mark: exits"),
            self._grant(role, duty, "DELETE", [spec.unpublished_partition], bad_row),
            self._grant(role, duty, "SELECT, INSERT, UPDATE, DELETE", dead, bad_row),
        ]

    def relay(self, role: str, *, see_sessions: bool) -> list[Check]:
        found = self._claims(role, "relay", flat=self.flat)
        if see_sessions:
            sees = bool(self._facts(role)[2])
            found.append(self._see(role, "relay", sees,
                                   "V2's switching relay does not switch while a superuser's "
                                   "or the owner's session is connected"))  # fmt: skip
        return found

    def cdc_relay(self, role: str) -> list[Check]:
        is_super, replication, *_ = self._facts(role)
        quoted = self.q(role)
        duty = "cdc relay"
        found = self._claims(role, duty, flat=False)
        found.append(Check(role, duty, "REPLICATION", bool(is_super or replication),
                           "no replication connection, no slot: exits",
                           f"ALTER ROLE {quoted} REPLICATION"))  # fmt: skip
        level = self.conn.execute("SHOW wal_level").fetchone()
        found.append(Check(role, duty, "wal_level = logical", bool(level and level[0] == "logical"),
                           "no logical slot on this server",
                           "ALTER SYSTEM SET wal_level = logical, then restart"))  # fmt: skip
        row = self.conn.execute(
            queries.query("privileges", "publication").compose(),
            {"role": role, "publication": self.publication},
        ).fetchone()
        partition = self.spec.unpublished_partition
        partition_reg = self.q(self.spec.schema, partition)
        ok: bool | None
        if row is not None:
            ok = bool(row[0])
        elif partition not in self.existing:
            ok = None  # created at V2: checked once it exists
        else:  # it creates it: that takes the partition's owner and CREATE on the database
            db_create = self._facts(role)[6]
            owns = self.conn.execute(
                "SELECT pg_has_role(%s::name, c.relowner, 'USAGE') FROM pg_class c "
                "WHERE c.oid = %s::regclass",
                (role, partition_reg),
            ).fetchone()
            ok = bool(is_super or (owns and owns[0] and db_create))
        what = f"owner of publication {self.publication} (or can create it)"
        found.append(Check(role, duty, what, ok,
                           "its first start cannot create or comment it: exits",
                           f"as the owner: CREATE PUBLICATION {self.publication} FOR TABLE "
                           f"{partition_reg} WITH (publish "
                           f"= 'insert'); then as a superuser (the owner may hand it over only "
                           f"if it may SET ROLE {quoted}, and {quoted} needs CREATE on the "
                           f"database): ALTER PUBLICATION {self.publication} OWNER TO "
                           f"{quoted}"))  # fmt: skip
        return found
