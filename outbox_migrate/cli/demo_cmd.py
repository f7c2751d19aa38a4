"""`outbox-migrate demo`: a whole migration under live load on the embedded PostgreSQL."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from outbox_migrate.cli.options import FormatOption, OutputFormat, ReportDirOption
from outbox_migrate.cli.plan_cmd import PatternName
from outbox_migrate.errors import harness_missing

DEMO_DB = "outbox_demo"  # a run's databases: `outbox_demo_<run id>` and `…_recording`


def register(app: typer.Typer) -> None:
    app.command(
        "demo",
        help="Run a pattern end to end under live load: writers and relays of every app "
        "version, rolling deploys, the runner's steps, and a report of produced, published, "
        "lost and duplicated messages, insert latency and publish gaps.\n\n"
        "Uses the embedded PostgreSQL unless --dsn is given (a run creates two databases "
        "there, outbox_demo_<run id> and …_recording; a later run drops them once nobody is "
        "connected).\n\n"
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
    output_dir: ReportDirOption = Path("reports"),
    wrong_choreography: Annotated[
        bool,
        typer.Option(
            help="Leave a V1 writer running when V3 is deployed: the runner must "
            "refuse, and the report names the rows that would have been stranded."
        ),
    ] = False,
    output: FormatOption = OutputFormat.text,
) -> None:
    from outbox_migrate.cli.console import render_demo_report

    try:
        from outbox_migrate_harness.sim import simulate
        from outbox_migrate_harness.sim.scenario import Scenario
    except ModuleNotFoundError as exc:
        raise harness_missing("demo", exc) from None

    scenario = Scenario(
        pattern.value, rate_per_s=rate, duration_s=duration, wrong_choreography=wrong_choreography
    )

    def run(db: str, recording: str, on_snapshot: Snapshots | None) -> dict[str, Any]:
        return simulate(db, recording, scenario, on_snapshot=on_snapshot, output_dir=output_dir)

    title = f"outbox-migrate demo: {pattern.value.upper()}"
    result = run_live(run, dsn, DEMO_DB, output, title, render_demo_report)
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


Snapshots = Callable[[Any], None]


def run_live(
    run: Callable[[str, str, Snapshots | None], dict[str, Any]],
    dsn: str,
    prefix: str,
    output: OutputFormat,
    title: str,
    render: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """`run` (a demo or a rehearsal) on its own databases (`run_databases`): a live view on
    stderr and `render`ed report for people, or the report as JSON; returns the report."""
    with run_databases(dsn, prefix) as (main_dsn, recording_dsn):
        if output is OutputFormat.json:
            from psycopg.conninfo import conninfo_to_dict

            from outbox_migrate.cli.console import print_json

            result = run(main_dsn, recording_dsn, None)
            result.pop("markers", None)
            result["database"] = conninfo_to_dict(main_dsn).get("dbname")
            print_json(result)
        else:
            from outbox_migrate.cli.console import demo_live

            with demo_live(title) as on_snapshot:
                result = run(main_dsn, recording_dsn, on_snapshot)
            render(result)
    return result


@contextmanager
def run_databases(dsn: str, prefix: str = DEMO_DB) -> Iterator[tuple[str, str]]:
    """A run's own two databases (`<prefix>_<run id>` and `…_recording`) on the chosen
    server, and their DSNs, for as long as the run lasts (docs/demo.md)."""
    import secrets

    from psycopg import sql
    from psycopg.conninfo import make_conninfo

    from outbox_migrate.db import connect, resolve_embedded

    base = resolve_embedded(dsn)
    run = f"{prefix}_{secrets.token_hex(4)}"
    names = (run, f"{run}_recording")
    comment = _RUN_COMMENT.format(prefix=prefix)
    with connect(base) as keeper:  # autocommit and idle: it only holds the run's lock
        # Taken before the databases exist: no later run drops them while this one holds it.
        keeper.execute("SELECT pg_advisory_lock(hashtext(%s))", (run,))
        _drop_ended_runs(keeper, comment)
        for name in names:
            keeper.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            keeper.execute(
                sql.SQL("COMMENT ON DATABASE {} IS {}").format(
                    sql.Identifier(name), sql.Literal(comment)
                )
            )
        yield make_conninfo(base, dbname=names[0]), make_conninfo(base, dbname=names[1])


_RUN_COMMENT = "outbox-migrate {prefix} run: dropped by a later run once this one has ended"


def _drop_ended_runs(conn: Any, comment: str) -> None:
    """Drop what earlier runs of this kind left, where their run is over: a database somebody
    is connected to stays (DROP without FORCE refuses), and so does one whose run holds its lock."""
    import psycopg
    from psycopg import sql

    rows = conn.execute(
        "SELECT datname FROM pg_database "
        "WHERE shobj_description(oid, 'pg_database') = %s AND datname NOT LIKE '%%\\_recording' "
        "ORDER BY datname",
        (comment,),
    ).fetchall()
    for (run,) in rows:
        locked = conn.execute("SELECT pg_try_advisory_lock(hashtext(%s))", (run,)).fetchone()
        if not (locked and locked[0]):
            continue  # that run is still going
        try:
            for name in (f"{run}_recording", run):
                with contextlib.suppress(psycopg.errors.ObjectInUse):
                    conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
        finally:
            conn.execute("SELECT pg_advisory_unlock(hashtext(%s))", (run,))
