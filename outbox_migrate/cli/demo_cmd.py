"""`outbox-migrate demo`: a whole migration under live load on the embedded PostgreSQL."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from outbox_migrate.cli.options import FormatOption, OutputFormat
from outbox_migrate.cli.plan_cmd import PatternName

DEMO_DB = "outbox_demo"
RECORDING_DB = "outbox_demo_recording"


def register(app: typer.Typer) -> None:
    app.command(
        "demo",
        help="Run a pattern end to end under live load: writers and relays of every app "
        "version, rolling deploys, the runner's steps, and a report of produced, published, "
        "lost and duplicated messages, insert latency and publish gaps.\n\n"
        "Uses the embedded PostgreSQL unless --dsn is given (two databases, outbox_demo and "
        "outbox_demo_recording, are created there and replaced on each run).\n\n"
        "Example: outbox-migrate demo --pattern hopia --rate 500 --duration 40",
    )(demo)


def demo(
    pattern: Annotated[
        PatternName,
        typer.Option("--pattern", "-p", help="Migration pattern to run.", case_sensitive=False),
    ] = PatternName.hoper,
    rate: Annotated[int, typer.Option(help="Inserts per second, across all writers.", min=1)] = 500,
    duration: Annotated[
        float, typer.Option(help="Approximate length of the rollout, seconds.", min=5)
    ] = 40.0,
    dsn: Annotated[
        str,
        typer.Option("--dsn", help="Server to run on ('embedded' starts a private one)."),
    ] = "embedded",
    output_dir: Annotated[
        Path, typer.Option(help="Where the PNG timeline and the HTML report go.")
    ] = Path("reports"),
    wrong_choreography: Annotated[
        bool,
        typer.Option(
            help="Leave a V1 writer running when V3 is deployed: the runner must "
            "refuse, and the report names the rows that would have been stranded."
        ),
    ] = False,
    output: FormatOption = OutputFormat.text,
) -> None:
    from outbox_migrate.sim import simulate
    from outbox_migrate.sim.scenario import Scenario

    main_dsn, recording_dsn = prepare_databases(dsn)
    scenario = Scenario(
        pattern.value, rate_per_s=rate, duration_s=duration, wrong_choreography=wrong_choreography
    )
    if output is OutputFormat.json:
        result = simulate(main_dsn, recording_dsn, scenario, output_dir=output_dir)
        from outbox_migrate.cli.console import print_json

        result.pop("markers", None)
        print_json(result)
    else:
        from outbox_migrate.cli.console import demo_live, render_demo_report

        with demo_live(pattern.value) as on_snapshot:
            result = simulate(
                main_dsn, recording_dsn, scenario, on_snapshot=on_snapshot, output_dir=output_dir
            )
        render_demo_report(result)
    if result.get("interrupted"):
        from outbox_migrate.cli.exits import set_interrupt_note

        files = result.get("files") or {}
        where = files.get("html") or "not written"
        set_interrupt_note(f"writers and relays stopped, partial report: {where}")
        raise KeyboardInterrupt
    if result["lost"]:
        from outbox_migrate.cli.wording import count
        from outbox_migrate.errors import OutboxMigrateError

        raise OutboxMigrateError(
            f"the demo lost {count(result['lost'], 'message')} (see the report above); a correct "
            "choreography loses none"
        )


def prepare_databases(
    dsn: str, names: tuple[str, str] = (DEMO_DB, RECORDING_DB)
) -> tuple[str, str]:
    """Fresh run and recording databases (`names`) on the chosen server; their DSNs."""
    from psycopg import sql
    from psycopg.conninfo import make_conninfo

    from outbox_migrate.db import connect, resolve_embedded

    base = resolve_embedded(dsn)
    with connect(base) as conn:
        for name in names:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))  # fmt: skip
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return make_conninfo(base, dbname=names[0]), make_conninfo(base, dbname=names[1])
