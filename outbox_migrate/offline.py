"""Compile steps to plain SQL for psql and Alembic `--sql`: each precondition becomes a `DO`
block that raises the violation's own message, so the safety checks travel with the SQL.
"""

from __future__ import annotations

from psycopg import sql

from outbox_migrate.config import OutboxSpec
from outbox_migrate.patterns.model import CheckPoint, Condition, Pattern, Step, TxMode


def assertion(step_id: str, condition: Condition) -> str:
    """`DO` block raising the first violation of `condition` (as the runner would print it)."""
    body = condition.sql_text()
    if "$om_assert$" in body:  # pragma: no cover - our own queries never contain it
        raise ValueError("condition text collides with the dollar-quote tag")
    # RAISE's format string: quote for the SQL literal, double % so names cannot act as slots.
    label = f"{step_id} [{condition.name}]".replace("'", "''").replace("%", "%%")
    return (
        "DO $om_assert$\n"
        "DECLARE violation text;\n"
        "BEGIN\n"
        f"    FOR violation IN {body}\n"
        "    LOOP\n"
        f"        RAISE EXCEPTION 'outbox-migrate: precondition of {label} failed: %', "
        "violation;\n"
        "    END LOOP;\n"
        "END\n"
        "$om_assert$;"
    )


def timeouts(step: Step, lock_timeout_ms: int) -> list[str]:
    statement = step.statement_timeout_ms or 0
    return [
        f"SET LOCAL lock_timeout = '{lock_timeout_ms}ms';",
        f"SET LOCAL statement_timeout = '{statement}ms';",
    ]


def lock_statements(
    step: Step, schema: str, parent: str, *, skip_created: bool = True
) -> list[str]:
    """`LOCK TABLE ONLY` for the step's declared locks, parent first (as the runner takes
    them), leaving out the relations the step itself creates (they do not exist yet)."""
    created = (
        {obj.name for obj in step.creates if obj.kind == "relation"} if skip_created else set()
    )
    ordered = sorted(step.locks, key=lambda lock: 0 if lock.relation == parent else 1)
    lines: list[str] = []
    for lock in ordered:
        if lock.relation in created:
            continue
        statement = sql.SQL("LOCK TABLE ONLY {} IN {} MODE;").format(
            sql.Identifier(schema, lock.relation), sql.SQL(lock.mode.sql_name)
        )
        lines.append(statement.as_string(None))
    return list(dict.fromkeys(lines))


def step_sql(
    step: Step,
    lock_timeout_ms: int,
    *,
    schema: str = "public",
    parent: str = "",
) -> list[str]:
    """The lines that apply `step` by hand: one transaction for transactional steps.

    Sampling and scanning checks run first, outside the transaction (a gate's window sleeps
    longer than a catalog step's statement_timeout, and no lock should be held meanwhile);
    then, inside it, the declared locks, then every other check — so what is asserted is what
    holds at COMMIT, as in the runner.
    """
    before = [c for c in step.preconditions if c.at is not CheckPoint.LOCKED]
    locked = step.conditions_at(CheckPoint.LOCKED)
    early = [assertion(step.id, c) for c in before]
    checks = [assertion(step.id, c) for c in locked]
    statements = [text.rstrip(";") + ";" for text in step.sql_texts()]
    if step.tx is TxMode.TRANSACTION:
        locks = lock_statements(step, schema, parent)
        return [*early, "BEGIN;", *timeouts(step, lock_timeout_ms), *locks, *checks,
                *statements, "COMMIT;"]  # fmt: skip
    if step.tx is TxMode.AUTOCOMMIT:
        return [*early, *checks, f"SET lock_timeout = '{lock_timeout_ms}ms';", *statements,
                "RESET lock_timeout;"]  # fmt: skip
    return [*early, *checks]


CDC_KIND = "publish-unpublished-partition"
CDC_PHASE = "V2"


def cdc_guard(pattern: Pattern, step: Step, spec: OutboxSpec) -> list[str]:
    """After the last step of V2, when the pattern was built without the live database (no
    CDC step: `plan` without `--dsn`, Alembic `--sql`): an assertion that no publication
    lists the old outbox without the unpublished partition, so a DBA applying offline SQL
    learns before deploying V2 that a CDC consumer would miss its messages."""
    if step.phase != CDC_PHASE or any(s.kind == CDC_KIND for s in pattern.steps()):
        return []
    v2 = pattern.phase(CDC_PHASE).steps
    if not v2 or v2[-1].id != step.id:
        return []
    from outbox_migrate.patterns import conditions as c
    from outbox_migrate.patterns.names import Names

    n = Names(spec)
    guard = c.condition("publications-carried", rel_reg=n.reg(n.table),
                        unpublished_reg=n.reg(n.unpublished))  # fmt: skip
    return [assertion(f"{step.id} (CDC)", guard)]
