"""The `outbox-migrate` console script: the command registry and the error boundary (`main`).
Commands import their library inside the function, so `--help` loads no rich, psycopg or
SQLAlchemy."""

from __future__ import annotations

import sys

import typer

from outbox_migrate import __version__
from outbox_migrate.cli import (
    alembic_cmd,
    config_cmd,
    copy_back_cmd,
    dead_letters_cmd,
    demo_cmd,
    maintain_cmd,
    ping_cmd,
    plan_cmd,
    rehearse_cmd,
    relay_cmd,
    roles_cmd,
    run_cmd,
    wizard_cmd,
)
from outbox_migrate.errors import ExitCode

HELP = """Move a live PostgreSQL outbox to a LIST-partitioned table, with zero downtime.

\b
Examples (each followed by what it does):
  outbox-migrate demo --pattern hoper
      a whole migration under live load, on an embedded PostgreSQL
  outbox-migrate wizard
      three questions -> the pattern for you, and why
  outbox-migrate plan --pattern hoper --dsn $DATABASE_URL
      the steps, their SQL and locks for your schema
  outbox-migrate run --pattern hoper --to V2 --dsn $DATABASE_URL
      one deploy's steps
  outbox-migrate status --dsn $DATABASE_URL --format json
      where the migration stands
  outbox-migrate config --format json
      the names and settings in force
  outbox-migrate ping --dsn embedded
      start the embedded PostgreSQL and connect
  outbox-migrate roles --dsn $DATABASE_URL
      what the owner, application and relay roles can do and see
  outbox-migrate relay --sink stdout --until-empty --dsn $DATABASE_URL
      publish what is there, then exit
  outbox-migrate copy-back --rate 50000 --dsn $DATABASE_URL
      HOPER: copy back, verify, drop
  outbox-migrate maintain --once --dsn $DATABASE_URL
      autovacuum, index bloat, retention
  outbox-migrate dead-letters requeue --reason 23505 --dsn $DATABASE_URL
      send dead letters again, with their headers
  outbox-migrate alembic generate --pattern hoper --dir .
      the steps as Alembic revisions

\b
Exit codes: 0 ok, 1 failed, 2 bad input, 3 busy, 4 lock budget,
5 precondition, 6 connection lost, 130 interrupted, 143 terminated
(docs/cli.md).
"""

app = typer.Typer(
    name="outbox-migrate",
    help=HELP,
    rich_markup_mode=None,  # plain click help: rich is not imported for --help
    pretty_exceptions_enable=False,
    invoke_without_command=True,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        sys.stdout.write(f"outbox-migrate {__version__}\n")
        raise typer.Exit(0)


@app.callback()
def root(
    ctx: typer.Context,
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    if ctx.invoked_subcommand is None:
        sys.stdout.write(ctx.get_help() + "\n")
        raise typer.Exit(0)


# In the order --help lists them.
for module in (demo_cmd, rehearse_cmd, wizard_cmd, plan_cmd, run_cmd, config_cmd, ping_cmd,
               roles_cmd, relay_cmd, copy_back_cmd, maintain_cmd, dead_letters_cmd,
               alembic_cmd):  # fmt: skip
    module.register(app)


def _lay_out_examples(commands: typer.Typer) -> None:
    """Every command's and group's `Example:` laid out for pasting (wording.help_examples),
    in one place rather than in each command's help text."""
    from outbox_migrate.cli.wording import help_examples

    for command in commands.registered_commands:
        if command.help:
            command.help = help_examples(command.help)
    for group in commands.registered_groups:
        if group.help:
            group.help = help_examples(group.help)
        if group.typer_instance is not None:
            info = group.typer_instance.info
            if isinstance(info.help, str):
                info.help = help_examples(info.help)
            _lay_out_examples(group.typer_instance)


_lay_out_examples(app)


def main(argv: list[str] | None = None) -> None:
    """Run the command, then exit with the code `exits.classify` gives: the only place the
    CLI exits (typer runs in non-standalone mode), so no path turns a failure into exit 0."""
    from outbox_migrate.cli import exits, signals

    args = list(sys.argv[1:] if argv is None else argv)
    exits.set_command(args)
    signals.install()  # the launcher did already; this covers `main` called in-process
    try:
        returned = app(args=args, prog_name="outbox-migrate", standalone_mode=False)
    except typer.Exit as exc:  # raised outside a command (never in practice) — honour it
        _exit(int(exc.exit_code or 0))
    except typer.Abort:  # stdin ended at a prompt
        _fail("aborted: stdin ended before the question was answered", int(ExitCode.FAILED))
    except typer.TyperException as exc:  # click's usage errors (unknown option, bad value)
        _fail(_usage_message(exc), int(ExitCode.USAGE))
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 — every outcome goes through the table
        code, message = exits.classify(exc)
        if exits.debug_enabled():
            import traceback

            traceback.print_exception(exc)
        for line in getattr(exc, "details", ()):  # several blockers: one line each, first
            sys.stderr.write(f"{line}\n")
        _fail(message, code)
    code = returned if isinstance(returned, int) else 0
    if code == int(ExitCode.INTERRUPTED):  # typer turns KeyboardInterrupt into a return of 130
        _fail(exits.interrupt_message(), signals.exit_code())
    _exit(code)


def _usage_message(exc: BaseException) -> str:
    message = getattr(exc, "format_message", lambda: str(exc))()
    return " ".join(str(message).split())


def _exit(code: int) -> None:
    from outbox_migrate.cli import exits, signals

    if signals.swallowed():  # interrupted, though Python dropped the exception
        _fail(exits.interrupt_message(), signals.exit_code())
    sys.stdout.flush()
    sys.exit(code)


def _fail(message: str, code: int) -> None:
    from outbox_migrate.cli import exits, signals

    if signals.swallowed() and code != signals.exit_code():
        # The command went on after an interrupt Python dropped, and ended as it did: the
        # exit still says it was interrupted (never 0, never another failure's code).
        message, code = exits.interrupt_message(), signals.exit_code()
    first = message.strip().splitlines()[0] if message.strip() else "error"
    sys.stderr.write(f"outbox-migrate: error: {first}\n")
    sys.stderr.flush()
    sys.exit(code)
