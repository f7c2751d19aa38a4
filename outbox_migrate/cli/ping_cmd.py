"""`outbox-migrate ping`: prove the DSN connects, and show the server it reaches."""

from __future__ import annotations

import typer

from outbox_migrate.cli.options import DsnOption, FormatOption, OutputFormat, report, require_dsn


def register(app: typer.Typer) -> None:
    app.command(
        "ping",
        help="Connect to the database and print the server version.\n\n"
        "Example: outbox-migrate ping --dsn $DATABASE_URL",
    )(ping)


def ping(dsn: DsnOption = None, output: FormatOption = OutputFormat.text) -> None:
    from outbox_migrate.db import connect, describe, server_version

    target = require_dsn(dsn)
    with connect(target) as conn:
        row = conn.execute("SHOW server_version").fetchone()
        info = {
            "database": describe(target),
            "server_version": str(row[0]) if row else "?",
            "major": server_version(conn),
            "current_database": conn.info.dbname,
            "user": conn.info.user,
        }
    report(output, info, f"connected to {info['database']}: PostgreSQL {info['server_version']} "
           f"(database {info['current_database']}, user {info['user']})")  # fmt: skip
