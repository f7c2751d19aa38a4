"""`outbox-migrate alembic generate`: a pattern's steps as revisions in an Alembic project."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from outbox_migrate.cli.options import (
    FormatOption,
    OptionalOption,
    OutputFormat,
    settings_from,
    with_names,
)
from outbox_migrate.cli.plan_cmd import PatternOption


class SplitChoice(StrEnum):
    step = "step"
    phase = "phase"


GROUP_HELP = (
    "Alembic integration: ship a pattern as revisions your CI applies.\n\n"
    "Generated revisions call op.outbox_step(...) from outbox_migrate.alembic_ext, which runs "
    "the step with the runner's preconditions, lock budget and ledger online, and compiles "
    "the preconditions to assertions under `alembic upgrade --sql`.\n\n"
    "Example: outbox-migrate alembic generate --pattern hoper --dir ."
)


def register(app: typer.Typer) -> None:
    group = typer.Typer(
        name="alembic",
        help=GROUP_HELP,
        no_args_is_help=True,
        rich_markup_mode=None,
        add_completion=False,
    )
    group.command(
        "generate",
        help="Write one revision per step of each deploy phase, chained after the project's "
        "head (or --down-revision), and print the revision that completes each phase.\n\n"
        "Example: outbox-migrate alembic generate --pattern hoper --dir . --format json",
    )(with_names(generate))
    app.add_typer(group, name="alembic")


def generate(
    pattern: PatternOption,
    directory: Annotated[
        Path,
        typer.Option("--dir", help="The Alembic project: a folder with alembic.ini, the ini "
                     "file itself, or the script directory (script.py.mako)."),
    ] = Path(),
    down_revision: Annotated[
        str | None,
        typer.Option(help="Chain after this revision instead of the head."),
    ] = None,
    split: Annotated[
        SplitChoice,
        typer.Option(help="step: one revision per step, each one transaction with "
                     "alembic_version (default); phase: one revision per phase."),
    ] = SplitChoice.step,
    tag: Annotated[
        str | None,
        typer.Option(help="Prefix of the revision ids (<tag>_hoper_v2_01) [random].",
                     show_default=False),
    ] = None,
    with_optional: OptionalOption = False,
    output: FormatOption = OutputFormat.text,
    *,
    names: dict[str, Any],
) -> None:  # fmt: skip
    from outbox_migrate.alembic_ext.generate import generate as write_revisions
    from outbox_migrate.alembic_ext.revisions import Split

    settings = settings_from(**names)
    result = write_revisions(
        pattern.value, settings, directory, down_revision=down_revision,
        split=Split(split.value), include_optional=with_optional, tag=tag,
    )  # fmt: skip
    if output is OutputFormat.json:
        from outbox_migrate.cli.console import print_json

        print_json(result.to_json())
        return
    from outbox_migrate.cli.console import table as print_table
    from outbox_migrate.cli.console import text
    from outbox_migrate.cli.wording import count

    print_table(
        f"{count(len(result.revisions), 'revision')} written to {result.script_location}/versions "
        f"(after {result.down_revision or 'base'})",
        ["revision", "phase", "step", "reversible"],
        [
            [r["revision"], r["phase"], ", ".join(s.split(".")[-1] for s in r["steps"]),
             "yes" if r["reversible"] else "no"]
            for r in result.revisions
        ],
    )  # fmt: skip
    text("Upgrade one phase at a time, deploying the application in between:")
    for phase, revision in result.phase_targets.items():
        text(f"  {phase}: alembic upgrade {revision}")
    for hint in result.hints:
        text(f"hint: {hint}")
