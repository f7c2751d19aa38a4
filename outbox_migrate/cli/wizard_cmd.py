"""`outbox-migrate wizard`: the decision flowchart as questions, answered or asked."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from outbox_migrate.cli.options import DsnOption, FormatOption, OutputFormat, with_names


def register(app: typer.Typer) -> None:
    app.command(
        "wizard",
        help="Recommend a migration pattern from three questions, and explain why.\n\n"
        "Asks interactively unless the answers are given as flags. With --dsn it also "
        "measures the live outbox (size, backlog, rates, CDC, FKs) and says how that bears "
        "on the choice.\n\n"
        "Example: outbox-migrate wizard --no-pause --keep-old-rows --no-immediate-access "
        "--format json",
    )(with_names(wizard))


def wizard(
    pause: Annotated[
        bool | None,
        typer.Option(help="Publication can pause for a few minutes."),
    ] = None,
    keep_old_rows: Annotated[
        bool | None,
        typer.Option(
            help="The old rows must become part of the partitioned table.",
        ),
    ] = None,
    immediate_access: Annotated[
        bool | None,
        typer.Option(
            help="Every published row must be readable from the final table at all times.",
        ),
    ] = None,
    dsn: DsnOption = None,
    output: FormatOption = OutputFormat.text,
    interactive: Annotated[
        bool | None,
        typer.Option(
            help="Ask for missing answers on stdin. Default: only when stdin is a terminal "
            "and --format is text.",
            show_default=False,
        ),
    ] = None,
    *,
    names: dict[str, Any],
) -> None:
    from outbox_migrate.cli.options import command_line, settings_from
    from outbox_migrate.errors import UsageError
    from outbox_migrate.wizard import (
        QUESTIONS,
        Answers,
        needs_immediate_access_question,
        recommend,
    )

    settings = settings_from(**names)  # bad names fail before any question is asked
    if interactive and output is not OutputFormat.text:
        raise UsageError("--interactive asks its questions on stdout; use it with --format text")
    if interactive is None:
        interactive = output is OutputFormat.text and sys.stdin.isatty()

    def ask(key: str, given: bool | None) -> bool:
        flag = key.replace("_", "-")
        if given is not None:
            return given
        if not interactive:
            raise UsageError(f"answer {QUESTIONS[key]!r} with --{flag} or --no-{flag}")
        from outbox_migrate.cli.console import confirm

        try:
            return confirm(QUESTIONS[key])
        except EOFError:
            raise UsageError(
                f"stdin ended before {QUESTIONS[key]!r} was answered; answer y or n, or pass "
                f"--{flag} / --no-{flag}"
            ) from None

    pause_answer = ask("pause", pause)
    keep_answer = ask("keep_old_rows", keep_old_rows)
    access_answer = immediate_access
    if needs_immediate_access_question(pause_answer, keep_answer):
        access_answer = ask("immediate_access", immediate_access)
    result = recommend(Answers(pause_answer, keep_answer, access_answer))
    document = result.to_json()
    from outbox_migrate.dsn import resolve

    resolved = resolve(dsn)
    if resolved is not None:
        from dataclasses import asdict

        from outbox_migrate.wizard import interpret, measure

        measured = measure(resolved.dsn, settings.spec, pattern=result.pattern)
        document["measurements"] = asdict(measured)
        document["notes"] = interpret(measured, result.pattern)
        if measured.id_column:  # the id plan suggests: the next command runs as printed
            names = {**names, "id_column": measured.id_column}
    document["next"] = command_line("plan", "--pattern", result.pattern, dsn=dsn, names=names)
    if output is OutputFormat.json:
        from outbox_migrate.cli.console import print_json

        print_json(document)
        return
    from outbox_migrate.cli.console import render_recommendation

    render_recommendation(document)
