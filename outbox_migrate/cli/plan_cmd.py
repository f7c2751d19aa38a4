"""`outbox-migrate plan`: the ordered, versioned steps of a pattern for the user's schema."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

import typer

from outbox_migrate.cli.options import (
    RUNNER_SETTINGS,
    DsnOption,
    OptionalOption,
    settings_from,
    with_names,
)


class PlanFormat(StrEnum):
    table = "table"
    markdown = "markdown"
    json = "json"
    sql = "sql"


class PatternName(StrEnum):
    cop = "cop"
    copra = "copra"
    hop = "hop"
    hoper = "hoper"
    hopia = "hopia"


PatternOption = Annotated[
    PatternName,
    typer.Option("--pattern", "-p", help="Migration pattern (see `outbox-migrate wizard`).",
                 case_sensitive=False),
]  # fmt: skip


def register(app: typer.Typer) -> None:
    app.command(
        "plan",
        help="Show a pattern's phases and steps: SQL, locks, scans, preconditions, rollback.\n\n"
        "With a DSN the live schema is introspected: concrete identity START, counts, "
        "estimated durations and blockers.\n\n"
        "Example: outbox-migrate plan --pattern hoper --dsn $DATABASE_URL "
        "--format sql > hoper.sql",
    )(with_names(plan, settings=RUNNER_SETTINGS))


def plan(
    pattern: PatternOption,
    dsn: DsnOption = None,
    output: Annotated[
        PlanFormat, typer.Option("--format", help="table, markdown, json or psql-runnable sql.")
    ] = PlanFormat.table,
    with_optional: OptionalOption = False,
    *,
    names: dict[str, Any],
) -> None:
    from outbox_migrate.dsn import resolve
    from outbox_migrate.patterns import build_from_settings
    from outbox_migrate.plan import plan_document, render_markdown, render_sql

    settings = settings_from(**names)
    facts = None
    resolved = resolve(dsn)
    if resolved is not None:
        from outbox_migrate.advisory.introspect import inspect, raise_for_blockers

        facts = inspect(resolved.dsn, settings.spec, pattern.value)
        if facts.blockers and output is PlanFormat.json:
            # A tool reads the blockers and their `fix_sql` from stdout; the exit stays 2.
            from outbox_migrate.cli.console import print_json
            from outbox_migrate.plan import blocked_document

            print_json(blocked_document(pattern.value, facts))
        raise_for_blockers(facts)
        from outbox_migrate.patterns.marker_catalog import resolve_settings

        settings = resolve_settings(resolved.dsn, settings)  # a flag marker's values
    built = build_from_settings(
        pattern.value,
        settings,
        include_optional=with_optional,
        identity_generation=facts.identity_generation(settings.spec) if facts else "ALWAYS",
        publications=tuple(facts.publication_details) if facts else (),
    )
    if output is PlanFormat.sql:
        import shutil

        from outbox_migrate.sql_layout import layout

        sql_text = render_sql(built, settings.spec, settings.lock_timeout_ms)
        # Laid out to the terminal's width, 80 when redirected to a file (COLUMNS wins).
        typer.echo(layout(sql_text, shutil.get_terminal_size((80, 24)).columns), nl=False)
    elif output is PlanFormat.markdown:
        typer.echo(render_markdown(built, settings.spec, facts), nl=False)
    elif output is PlanFormat.json:
        from outbox_migrate.cli.console import print_json

        print_json(plan_document(built, settings.spec, facts))
    else:
        from outbox_migrate.cli.console import render_plan

        render_plan(plan_document(built, settings.spec, facts))
