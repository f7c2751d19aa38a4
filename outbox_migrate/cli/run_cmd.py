"""`run`, `next`, `status`, `verify`, `rollback`, `reset`: the runner from the command line."""

from __future__ import annotations

import sys
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any

import typer

from outbox_migrate.cli.options import (
    OPTIONAL_PHASES,
    PATTERN_SETTINGS,
    RUNNER_SETTINGS,
    DsnOption,
    FormatOption,
    OptionalOption,
    OutputFormat,
    ToOption,
    report,
    require_dsn,
    settings_from,
    with_names,
)
from outbox_migrate.cli.plan_cmd import PatternName, PatternOption

if TYPE_CHECKING:
    from outbox_migrate.runner import Runner


class LongTx(StrEnum):
    wait = "wait"
    refuse = "refuse"


LongTxOption = Annotated[
    LongTx,
    typer.Option(
        "--on-long-tx",
        help="Before an ACCESS EXCLUSIVE step, when long transactions hold locks on its "
        "tables: 'wait' (retry within the lock budget) or 'refuse'.",
    ),
]
ActivePatternOption = Annotated[
    PatternName | None,
    typer.Option(
        "--pattern", "-p", case_sensitive=False, show_default=False,
        help="Migration pattern [the table's active migration, from the ledger].",
    ),
]  # fmt: skip


def register(app: typer.Typer) -> None:
    app.command(
        "run",
        help="Run the steps of a pattern up to the end of a phase, then stop at that deploy "
        "boundary.\n\nExample: outbox-migrate run --pattern hoper --to V2 --dsn $DATABASE_URL",
    )(with_names(run, settings=RUNNER_SETTINGS))
    app.command(
        "next", help="Run exactly one pending step.\n\n"
        "Example: outbox-migrate next --pattern hoper --dsn $DATABASE_URL",
    )(with_names(next_step, settings=RUNNER_SETTINGS))  # fmt: skip
    app.command(
        "status",
        help="Show the migration's phase and every step's state, attempts and timings. "
        "With --watch, refresh every --interval seconds with what only the live server knows: "
        "the runner at work, who holds a lock the next step needs, which of its checks fail "
        "now (a gate's 'not yet'), the relay's backlog, copy-back and VALIDATE progress.\n\n"
        "Example: outbox-migrate status --format json",
    )(with_names(status, settings=PATTERN_SETTINGS))
    app.command(
        "verify",
        help="Check that the invariants of the current phase hold on the live database.\n\n"
        "Example: outbox-migrate verify --dsn $DATABASE_URL",
    )(with_names(verify, settings=PATTERN_SETTINGS))
    app.command(
        "rollback",
        help="Undo the steps after a phase, newest first (up to the point of no return).\n\n"
        "Example: outbox-migrate rollback --pattern hoper --to V3 --dsn $DATABASE_URL",
    )(with_names(rollback, settings=RUNNER_SETTINGS))
    app.command(
        "reset",
        help="Abandon a stuck migration record (schema objects are left as they are).\n\n"
        "Example: outbox-migrate reset --yes",
    )(with_names(reset, settings=RUNNER_SETTINGS))


def _runner(
    pattern: str,
    dsn: str | None,
    output: OutputFormat,
    names: dict[str, Any],
    with_optional: bool = False,
    on_long_tx: LongTx = LongTx.wait,
) -> Runner:
    from outbox_migrate.cli.console import runner_events
    from outbox_migrate.cli.exits import TrackedEvents
    from outbox_migrate.runner import Runner

    _quiet_psycopg()
    return Runner(
        require_dsn(dsn),
        settings_from(**names),
        pattern,
        include_optional=with_optional,
        events=TrackedEvents(runner_events(json_lines=output is OutputFormat.json)),
        on_long_tx=on_long_tx.value,
    )


def _quiet_psycopg() -> None:
    """An interrupt can leave a step's session busy, and psycopg then logs the ROLLBACK it
    could not send ("error ignored in rollback of <psycopg.Transaction …>", with host, user
    and database) at WARNING; with no handler anywhere Python's last resort printed it on
    stderr above the one error line, which already says what became of the step."""
    import logging

    psycopg_log = logging.getLogger("psycopg")
    if not any(isinstance(h, logging.NullHandler) for h in psycopg_log.handlers):
        psycopg_log.addHandler(logging.NullHandler())


def _report(result: Any, output: OutputFormat, runner: Runner | None = None) -> None:
    from dataclasses import asdict

    following = _what_next(result, runner) if runner is not None else None
    if output is OutputFormat.json:
        from outbox_migrate.cli.console import print_json

        print_json({"event": "result", **asdict(result), "next": following}, indent=None)
        return
    from outbox_migrate.cli.console import text
    from outbox_migrate.cli.wording import count

    state = (
        "migration complete"
        if result.completed
        else f"stopped inside {result.inside} ({result.phase} complete)"
        if getattr(result, "inside", None)
        else f"stopped at the end of {result.phase}"
    )
    text(f"{result.pattern.upper()}: ran {count(len(result.ran), 'step')}, adopted "
         f"{len(result.adopted)}, {state}")  # fmt: skip
    if following:
        from outbox_migrate.cli.console import advice

        advice(following)


def _what_next(result: Any, runner: Runner) -> str | None:
    """What the operator does at this boundary: deploy the version the database is now
    ready for, then run the next phase (or nothing, when the migration is complete)."""
    if result.completed:
        return None
    pattern = runner.pattern
    if getattr(result, "inside", None):
        # Part-way into a phase: its deploy boundary is not reached yet, nothing to deploy.
        return (f"{result.inside}'s steps have begun; run the rest of them: `outbox-migrate "
                f"run --pattern {pattern.name} --to {result.inside}`")  # fmt: skip
    names = [phase.name for phase in pattern.phases]
    if result.phase not in names:
        return None
    index = names.index(result.phase)
    reached = pattern.phases[index]
    spec = runner.spec
    upcoming = pattern.phases[index + 1] if index + 1 < len(names) else None
    then = (
        f"then `outbox-migrate run --pattern {pattern.name} --to {upcoming.name}`"
        if upcoming is not None
        else ""
    )
    if reached.kind.value == "deploy" and index > 0:
        app = reached.app.describe(spec.table, spec.partitioned_table)
        deploy = f"deploy application version {reached.name} ({app})"
        if reached.app.publishes_from.value == "old-then-new":
            # The switching relay's default gate waits for this; nothing else tells them.
            previous = pattern.phases[index - 1].name
            from outbox_migrate.patterns.names import ident

            old = spec.table if spec.schema == "public" else f"{spec.schema}.{spec.table}"
            deploy += (
                f"; once {previous} is gone, as the owner of {old}: REVOKE INSERT ON "
                f"{ident(spec.schema, spec.table)} FROM <the application's role> (the "
                f"switching relay leaves {old} only then)"
            )
        return f"{deploy}, {then}".rstrip(", ")
    return then.removeprefix("then ") or None


def run(
    pattern: PatternOption,
    to: ToOption,
    dsn: DsnOption = None,
    output: FormatOption = OutputFormat.text,
    with_optional: OptionalOption = False,
    on_long_tx: LongTxOption = LongTx.wait,
    *,
    names: dict[str, Any],
) -> None:
    if to in OPTIONAL_PHASES and not with_optional:
        from outbox_migrate.errors import UsageError

        # Not implied: --with-optional also brings the other optional steps (an irreversible
        # drop among them), which the operator must have chosen.
        raise UsageError(
            f"{to.value} is an optional phase: run it with --with-optional (`plan "
            "--with-optional` lists every optional step that flag includes)"
        )
    runner = _runner(pattern.value, dsn, output, names, with_optional, on_long_tx)
    with runner:
        result = runner.run(to.value)
    _report(result, output, runner)


def next_step(
    pattern: PatternOption,
    dsn: DsnOption = None,
    output: FormatOption = OutputFormat.text,
    with_optional: OptionalOption = False,
    on_long_tx: LongTxOption = LongTx.wait,
    *,
    names: dict[str, Any],
) -> None:
    runner = _runner(pattern.value, dsn, output, names, with_optional, on_long_tx)
    with runner:
        result = runner.next()
    _report(result, output, runner)


def status(
    pattern: ActivePatternOption = None,
    dsn: DsnOption = None,
    output: FormatOption = OutputFormat.text,
    with_optional: OptionalOption = False,
    watch: Annotated[
        bool, typer.Option("--watch", help="Refresh until Ctrl-C, with live locks and gates.")
    ] = False,
    interval: Annotated[float, typer.Option(help="Seconds between --watch frames.", min=0.1)] = 2.0,
    count: Annotated[
        int | None,
        typer.Option(help="Stop --watch after this many frames.", min=1, show_default=False),
    ] = None,
    *,
    names: dict[str, Any],
) -> None:
    from outbox_migrate.cli.options import require_positive
    from outbox_migrate.runner import inspect

    require_positive("--interval", interval)  # inf passed min=0.1: an internal error, exit 1
    settings = settings_from(**names)
    name = pattern.value if pattern else None
    if watch:
        from outbox_migrate.cli import watch as live

        target = require_dsn(dsn)
        live.watch(
            lambda: live.frame(target, settings, name),
            interval_s=interval,
            count=count,
            json_lines=output is OutputFormat.json,
        )
        return
    document = inspect.status(require_dsn(dsn), settings, name, include_optional=with_optional)
    if output is OutputFormat.json:
        from outbox_migrate.cli.console import print_json

        print_json(document)
        return
    if not document["recorded"]:
        from outbox_migrate.cli.console import text

        text(inspect.not_recorded_message(settings, name, document.get("active_pattern")))
        return
    from outbox_migrate.attempt_log import latest_attempts
    from outbox_migrate.cli.console import render_status

    render_status(document, latest_attempts(require_dsn(dsn), settings.spec, document["pattern"]))


def verify(
    pattern: ActivePatternOption = None,
    dsn: DsnOption = None,
    output: FormatOption = OutputFormat.text,
    with_optional: OptionalOption = False,
    *,
    names: dict[str, Any],
) -> None:
    from outbox_migrate.errors import VerifyFailed
    from outbox_migrate.runner import inspect

    settings = settings_from(**names)
    name = pattern.value if pattern else None
    table = inspect.table_label(settings)
    try:
        phase = inspect.verify(require_dsn(dsn), settings, name, include_optional=with_optional)
    except VerifyFailed as failed:
        if output is OutputFormat.json:  # the same document, its violations listed; exit 1
            from outbox_migrate.cli.console import print_json

            print_json({"table": table, "phase": failed.phase, "violations": failed.violations})
        raise
    data = {"table": table, "phase": phase, "violations": []}
    report(output, data, f"every invariant of phase {phase} holds on {table}")


def rollback(
    to: ToOption,
    pattern: ActivePatternOption = None,
    dsn: DsnOption = None,
    output: FormatOption = OutputFormat.text,
    with_optional: OptionalOption = False,
    on_long_tx: LongTxOption = LongTx.wait,
    *,
    names: dict[str, Any],
) -> None:
    from outbox_migrate.errors import UsageError
    from outbox_migrate.runner import inspect

    name = pattern.value if pattern else None
    if name is None:
        settings = settings_from(**names)
        name = inspect.active_pattern(require_dsn(dsn), settings)
        if name is None:
            raise UsageError(f"no migration recorded for {inspect.table_label(settings)} to "
                             "roll back")  # fmt: skip
    runner = _runner(name, dsn, output, names, with_optional, on_long_tx)
    with runner:
        undone = runner.rollback(to.value)
    from outbox_migrate.cli.wording import count

    if output is OutputFormat.json:
        from outbox_migrate.cli.console import print_json

        # One line, as `run`'s: the step events before it are JSON lines too.
        print_json({"event": "result", "rolled_back": undone, "phase": to.value}, indent=None)
        return
    report(output, {"rolled_back": undone, "phase": to.value},
           f"rolled back {count(len(undone), 'step')}; now at the end of {to.value}")  # fmt: skip


def reset(
    pattern: ActivePatternOption = None,
    dsn: DsnOption = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Abandon the record even while steps of it are applied (the schema stays as "
            "it is; nothing will undo those steps). Without it, roll back to V1 first.",
        ),
    ] = False,
    *,
    names: dict[str, Any],
) -> None:
    from outbox_migrate.cli.console import confirm, text
    from outbox_migrate.errors import NothingDone, UsageError
    from outbox_migrate.runner import inspect

    if not yes:
        if not sys.stdin.isatty():
            raise UsageError("reset needs confirmation: pass --yes")
        if not confirm("Abandon the active migration record? Schema objects stay as they are."):
            raise NothingDone("reset not confirmed; the migration record is unchanged")
    name = pattern.value if pattern else None
    if name is None:  # the record to abandon is the table's active one, whatever its pattern
        name = inspect.active_pattern(require_dsn(dsn), settings_from(**names))
    if name is None:
        text("no active migration to reset")
        return
    runner = _runner(name, dsn, OutputFormat.text, names)
    with runner:
        changed = runner.reset(force=force)
    text("migration record abandoned" if changed else "no active migration to reset")
