"""`run`, `next`, `status`, `verify`, `rollback`, `reset`: the runner from the command line."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from outbox_migrate.cli.options import (
    DsnOption,
    FormatOption,
    OutputFormat,
    SchemaOption,
    TableOption,
    settings_from,
)
from outbox_migrate.cli.plan_cmd import PatternOption

if TYPE_CHECKING:
    from outbox_migrate.runner import Runner

ToOption = Annotated[str, typer.Option("--to", help="Phase to reach (V2, V3, V4, copy-back).")]
OptionalOption = Annotated[
    bool, typer.Option(help="Include optional steps (SET NOT NULL, final drops).")
]
LongTxOption = Annotated[
    str,
    typer.Option(
        "--on-long-tx",
        help="Before an ACCESS EXCLUSIVE step, when long transactions hold locks on its "
        "tables: 'wait' (retry within the lock budget) or 'refuse'.",
    ),
]
LockTimeoutOption = Annotated[
    int | None, typer.Option(help="lock_timeout per attempt, ms [200].", show_default=False)
]
BudgetOption = Annotated[
    float | None, typer.Option(help="Lock retry budget per step, s [60].", show_default=False)
]


def register(app: typer.Typer) -> None:
    app.command(
        "run",
        help="Run the steps of a pattern up to the end of a phase, then stop at that deploy "
        "boundary.\n\nExample: outbox-migrate run --pattern hoper --to V2 --dsn $DATABASE_URL",
    )(run)
    app.command(
        "next", help="Run exactly one pending step.\n\n"
        "Example: outbox-migrate next --pattern hoper --dsn $DATABASE_URL",
    )(next_step)  # fmt: skip
    app.command(
        "status",
        help="Show the migration's phase and every step's state, attempts and timings.\n\n"
        "Example: outbox-migrate status --pattern hoper --format json",
    )(status)
    app.command(
        "verify",
        help="Check that the invariants of the current phase hold on the live database.\n\n"
        "Example: outbox-migrate verify --pattern hoper --dsn $DATABASE_URL",
    )(verify)
    app.command(
        "rollback",
        help="Undo the steps after a phase, newest first (up to the point of no return).\n\n"
        "Example: outbox-migrate rollback --pattern hoper --to V3 --dsn $DATABASE_URL",
    )(rollback)
    app.command(
        "reset",
        help="Abandon a stuck migration record (schema objects are left as they are).\n\n"
        "Example: outbox-migrate reset --pattern hoper --yes",
    )(reset)


def _runner(
    pattern: str,
    dsn: str | None,
    output: OutputFormat,
    *,
    schema: str | None = None,
    table: str | None = None,
    with_optional: bool = False,
    on_long_tx: str = "wait",
    lock_timeout_ms: int | None = None,
    lock_budget_s: float | None = None,
) -> Runner:
    from outbox_migrate.dsn import resolve
    from outbox_migrate.errors import UsageError
    from outbox_migrate.runner import Runner

    settings = settings_from(
        schema=schema, table=table, lock_timeout_ms=lock_timeout_ms, lock_budget_s=lock_budget_s
    )
    resolved = resolve(dsn)
    if resolved is None:
        raise UsageError("no database given: pass --dsn, set OUTBOX_MIGRATE_DSN or PG* variables")
    if on_long_tx not in ("wait", "refuse"):
        raise UsageError(f"--on-long-tx must be 'wait' or 'refuse', not {on_long_tx!r}")
    from outbox_migrate.cli.console import runner_events

    return Runner(
        resolved.dsn,
        settings,
        pattern,
        include_optional=with_optional,
        events=runner_events(json_lines=output is OutputFormat.json),
        on_long_tx=on_long_tx,
    )


def _report(result: Any, output: OutputFormat) -> None:
    from dataclasses import asdict

    if output is OutputFormat.json:
        from outbox_migrate.cli.console import print_json_line

        print_json_line({"event": "result", **asdict(result)})
        return
    from outbox_migrate.cli.console import text

    state = "migration complete" if result.completed else f"stopped at the end of {result.phase}"
    text(f"{result.pattern.upper()}: ran {len(result.ran)} steps, adopted "
         f"{len(result.adopted)}, {state}")  # fmt: skip


def run(
    pattern: PatternOption,
    to: ToOption,
    dsn: DsnOption = None,
    output: FormatOption = OutputFormat.text,
    with_optional: OptionalOption = False,
    on_long_tx: LongTxOption = "wait",
    lock_timeout_ms: LockTimeoutOption = None,
    lock_budget_s: BudgetOption = None,
    schema: SchemaOption = None,
    table: TableOption = None,
) -> None:
    runner = _runner(
        pattern.value, dsn, output, schema=schema, table=table, with_optional=with_optional,
        on_long_tx=on_long_tx, lock_timeout_ms=lock_timeout_ms, lock_budget_s=lock_budget_s,
    )  # fmt: skip
    with runner:
        result = runner.run(to)
    _report(result, output)


def next_step(
    pattern: PatternOption,
    dsn: DsnOption = None,
    output: FormatOption = OutputFormat.text,
    with_optional: OptionalOption = False,
    schema: SchemaOption = None,
    table: TableOption = None,
) -> None:
    runner = _runner(pattern.value, dsn, output, schema=schema, table=table,
                     with_optional=with_optional)  # fmt: skip
    with runner:
        result = runner.next()
    _report(result, output)


def status(
    pattern: PatternOption,
    dsn: DsnOption = None,
    output: FormatOption = OutputFormat.text,
    with_optional: OptionalOption = False,
    schema: SchemaOption = None,
    table: TableOption = None,
) -> None:
    runner = _runner(pattern.value, dsn, output, schema=schema, table=table,
                     with_optional=with_optional)  # fmt: skip
    with runner:
        document = runner.status()
    if output is OutputFormat.json:
        from outbox_migrate.cli.console import print_json

        print_json(document)
        return
    from outbox_migrate.cli.console import render_status

    render_status(document)


def verify(
    pattern: PatternOption,
    dsn: DsnOption = None,
    output: FormatOption = OutputFormat.text,
    with_optional: OptionalOption = False,
    schema: SchemaOption = None,
    table: TableOption = None,
) -> None:
    runner = _runner(pattern.value, dsn, output, schema=schema, table=table,
                     with_optional=with_optional)  # fmt: skip
    with runner:
        phase = runner.verify_or_raise()
    if output is OutputFormat.json:
        from outbox_migrate.cli.console import print_json

        print_json({"phase": phase, "violations": []})
    else:
        from outbox_migrate.cli.console import text

        text(f"every invariant of phase {phase} holds")


def rollback(
    pattern: PatternOption,
    to: ToOption,
    dsn: DsnOption = None,
    output: FormatOption = OutputFormat.text,
    with_optional: OptionalOption = False,
    schema: SchemaOption = None,
    table: TableOption = None,
) -> None:
    runner = _runner(pattern.value, dsn, output, schema=schema, table=table,
                     with_optional=with_optional)  # fmt: skip
    with runner:
        undone = runner.rollback(to)
    if output is OutputFormat.json:
        from outbox_migrate.cli.console import print_json

        print_json({"rolled_back": undone, "phase": to})
    else:
        from outbox_migrate.cli.console import text

        text(f"rolled back {len(undone)} steps; now at the end of {to}")


def reset(
    pattern: PatternOption,
    dsn: DsnOption = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    schema: SchemaOption = None,
    table: TableOption = None,
) -> None:
    if not yes:
        import sys

        from outbox_migrate.errors import UsageError

        if not sys.stdin.isatty():
            raise UsageError("reset needs confirmation: pass --yes")
        from outbox_migrate.cli.console import confirm

        if not confirm("Abandon the active migration record? Schema objects stay as they are."):
            raise typer.Exit(1)
    runner = _runner(pattern.value, dsn, OutputFormat.text, schema=schema, table=table)
    with runner:
        changed = runner.reset()
    from outbox_migrate.cli.console import text

    text("migration record abandoned" if changed else "no active migration to reset")
