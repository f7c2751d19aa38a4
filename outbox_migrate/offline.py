"""Compile steps to plain SQL for psql and Alembic `--sql`: preconditions become assertions.

Each precondition turns into a `DO` block that raises the violation's own message, so the
safety checks travel with SQL a DBA applies by hand. Inside BEGIN … COMMIT the raise aborts the
whole step: nothing is half-applied.
"""

from __future__ import annotations

from outbox_migrate.patterns.model import Condition, Step, TxMode


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


def step_sql(step: Step, lock_timeout_ms: int, *, with_assertions: bool = True) -> list[str]:
    """The lines that apply `step` by hand: one transaction for transactional steps."""
    checks = [assertion(step.id, c) for c in step.preconditions] if with_assertions else []
    statements = [text.rstrip(";") + ";" for text in step.sql_texts()]
    if step.tx is TxMode.TRANSACTION:
        # Assertions first: the deploy-gate sampling sleeps longer than a catalog step's
        # statement_timeout, and they take no lock stronger than ACCESS SHARE.
        return ["BEGIN;", *checks, *timeouts(step, lock_timeout_ms), *statements, "COMMIT;"]
    if step.tx is TxMode.AUTOCOMMIT:
        return [*checks, f"SET lock_timeout = '{lock_timeout_ms}ms';", *statements,
                "RESET lock_timeout;"]  # fmt: skip
    return checks
