"""`outbox-migrate roles`: what each role the docs name can do and see on this database, and
what each missing grant costs (role_check.py; exit codes: docs/roles.md). Reads only."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

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

if TYPE_CHECKING:
    import psycopg

    from outbox_migrate.config import Settings
    from outbox_migrate.patterns.model import AppBehaviour

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

    settings = settings_from(**names)
    spec = settings.spec
    target = require_dsn(dsn)
    with connect(target) as conn:
        conn.execute("SET default_transaction_read_only = on")
        uses = _current_phase(conn, settings)
        checks = role_check.check_roles(
            conn,
            spec,
            owner=owner,
            apps=app or (),
            relays=relay or (),
            cdc_relays=cdc_relay or (),
            pattern=pattern.value if pattern else None,
            publication=publication or DEFAULT_PUBLICATION,
            uses=uses,
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
            [(c.role, c.duty, c.what, "NOT CHECKED" if c.what == role_check.NOT_CHECKED
              else mark[c.ok], c.cost) for c in checks],
        )  # fmt: skip
        for duty in role_check.not_checked(checks):  # said in words: "-" is no pass
            text(f"{duty}: not checked — no role found for it; name it with "
                 f"--{duty.replace(' ', '-')}")  # fmt: skip
        for gap in role_check.missing(checks):  # each statement of its fix on a line, whole
            text(f"{gap.role} ({gap.duty}) is missing {gap.what}:")
            for statement in gap.fix.split("; "):
                out().print(f"  {statement}", markup=False, highlight=False)
    if role_check.missing(checks):
        raise role_check.refusal(checks)


def _current_phase(conn: psycopg.Connection[Any], settings: Settings) -> AppBehaviour | None:
    """What the application version of the table's migration's current phase inserts into and
    publishes from, read from the ledger as `status` does; None when no migration is recorded
    or this role may not read the ledger (every outbox table that exists is then checked).

    With no migration recorded the table must exist (`status --table nosuch` exits 2 the
    same way): the default partitioned table's name would otherwise be checked in its place.
    A recorded one may have dropped its flat table once retired."""
    import psycopg

    from outbox_migrate.errors import UsageError
    from outbox_migrate.runner import inspect
    from outbox_migrate.runner.admission import require_table
    from outbox_migrate.runner.decide import reached_phase
    from outbox_migrate.runner.facts import live_pattern

    try:
        found = inspect.recorded(conn, settings, None)
    except (UsageError, psycopg.errors.InsufficientPrivilege):
        found = None  # the ledger is not this role's to read: judged by the tables there
    if found is None or found.migration is None:
        require_table(conn, settings.spec)
        return None
    migration = found.migration
    pattern = live_pattern(conn, settings, migration.pattern, False, ledger_readable=True)[0]
    return pattern.phase(reached_phase(pattern, migration.current_phase, found.steps)).app
