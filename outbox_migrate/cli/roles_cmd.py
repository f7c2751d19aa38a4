"""`outbox-migrate roles`: what each role the docs name can do and see on this database, and
what each missing grant costs (role_check.py; exit codes: docs/roles.md). Reads only."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from outbox_migrate.cli.options import (
    DsnOption,
    FormatOption,
    OutputFormat,
    require_dsn,
    settings_from,
    with_names,
)
from outbox_migrate.cli.plan_cmd import PatternName

HELP = (
    "For the runner (the table's owner), the application, the relay and the CDC relay: what "
    "each can and cannot do and see on this database, and what each missing grant costs. "
    "Defaults: the outbox's owner, the roles with INSERT on it (application) and with UPDATE "
    "(relay). Exit 5 when something is missing.\n\n"
    "Example: outbox-migrate roles --format json --dsn $DATABASE_URL"
)


def register(app: typer.Typer) -> None:
    app.command("roles", help=HELP)(with_names(roles))


def roles(
    dsn: DsnOption = None,
    owner: Annotated[
        str | None, typer.Option(help="The runner's role (default: the owner).")
    ] = None,
    app: Annotated[
        list[str] | None,
        typer.Option(help="An application role (repeatable; default: roles with INSERT)."),
    ] = None,
    relay: Annotated[
        list[str] | None,
        typer.Option(help="A relay role (repeatable; default: roles with UPDATE)."),
    ] = None,
    cdc_relay: Annotated[
        list[str] | None,
        typer.Option(help="A CDC relay role (repeatable; default: none)."),
    ] = None,
    pattern: Annotated[
        PatternName | None,
        typer.Option(
            "--pattern",
            "-p",
            case_sensitive=False,
            help="The migration's pattern: with cop or copra the relay need not see "
            "other roles' sessions (no switching relay). Default: checked.",
        ),
    ] = None,
    publication: Annotated[str | None, typer.Option(help="The CDC relay's publication.")] = None,
    output: FormatOption = OutputFormat.text,
    *,
    names: dict[str, Any],
) -> None:
    from outbox_migrate.advisory import role_check
    from outbox_migrate.db import connect
    from outbox_migrate.relay.options import DEFAULT_PUBLICATION

    spec = settings_from(**names).spec
    target = require_dsn(dsn)
    with connect(target) as conn:
        conn.execute("SET default_transaction_read_only = on")
        checks = role_check.check_roles(
            conn,
            spec,
            owner=owner,
            apps=app or (),
            relays=relay or (),
            cdc_relays=cdc_relay or (),
            pattern=pattern.value if pattern else None,
            publication=publication or DEFAULT_PUBLICATION,
        )
    if output is OutputFormat.json:
        from outbox_migrate.cli.console import print_json

        print_json(role_check.as_json(checks))
    else:
        from outbox_migrate.cli.console import out, table, text

        mark = {True: "yes", False: "NO", None: "-"}
        table(
            f"roles on {spec.schema}.{spec.table}",
            ["role", "as", "can", "ok", "if missing"],
            [(c.role, c.duty, c.what, mark[c.ok], c.cost) for c in checks],
        )
        for gap in role_check.missing(checks):  # each statement of its fix on a line, whole
            text(f"{gap.role} ({gap.duty}) is missing {gap.what}:")
            for statement in gap.fix.split("; "):
                out().print(f"  {statement}", markup=False, highlight=False)
    if role_check.missing(checks):
        raise role_check.refusal(checks)
