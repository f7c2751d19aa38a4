"""`outbox-migrate rehearse`: the pattern on a copy of the live outbox, under its measured load."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from outbox_migrate.cli.options import (
    DsnOption,
    FormatOption,
    OutputFormat,
    ReportDirOption,
    with_names,
)
from outbox_migrate.cli.plan_cmd import PatternOption

SCRATCH_DB = "outbox_rehearsal"  # a run's databases: `outbox_rehearsal_<run id>`, `…_recording`


def register(app: typer.Typer) -> None:
    app.command(
        "rehearse",
        help="Rehearse a pattern on a copy of your outbox before production: read the live "
        "table's shape and insert/publish rates (read-only), rebuild and fill it in a scratch "
        "database, run every phase there under that load with writers and relays of each "
        "application version, and report lost, duplicated, insert stalls, publish gaps, each "
        "step's lock wait, and VALIDATE/copy-back times extrapolated to the real size.\n\n"
        "The source is only read (sessions run read-only; SELECT is enough). A run creates "
        "two databases on the scratch server, outbox_rehearsal_<run id> and …_recording; a "
        "later run drops them once nobody is connected. Exit 1 if anything was lost.\n\n"
        "Example: outbox-migrate rehearse --pattern hoper --dsn $DATABASE_URL --rows 50000 "
        "--seconds 30",
    )(with_names(rehearse))


def rehearse(
    pattern: PatternOption,
    dsn: DsnOption = None,
    scratch_dsn: Annotated[
        str,
        typer.Option(
            "--scratch-dsn",
            help="Server for the copy ('embedded' starts a private one). Never the source's "
            "database.",
        ),
    ] = "embedded",
    rows: Annotated[
        int, typer.Option(help="Rows the copy starts with.", min=1, max=50_000_000)
    ] = 100_000,
    seconds: Annotated[
        float, typer.Option(help="Approximate length of the rehearsed rollout.", min=5)
    ] = 40.0,
    measure_seconds: Annotated[
        float, typer.Option(help="How long the live insert/publish rates are sampled.", min=1)
    ] = 5.0,
    sample: Annotated[
        bool,
        typer.Option(
            help="Copy the newest real rows instead of made-up ones (real payloads then "
            "leave the source)."
        ),
    ] = False,
    output_dir: ReportDirOption = Path("reports"),
    output: FormatOption = OutputFormat.text,
    *,
    names: dict[str, Any],
) -> None:
    from outbox_migrate.cli.console import render_rehearsal_report
    from outbox_migrate.cli.demo_cmd import Snapshots, run_live
    from outbox_migrate.cli.options import settings_from
    from outbox_migrate.dsn import resolve
    from outbox_migrate.errors import OutboxMigrateError, UsageError
    from outbox_migrate.rehearse import RehearsalRequest, check_source
    from outbox_migrate.rehearse import rehearse as run_rehearsal

    source = resolve(dsn)
    if source is None:
        raise UsageError("rehearse needs the live database: --dsn or $OUTBOX_MIGRATE_DSN")
    spec = settings_from(**names).spec
    base = _scratch_server(scratch_dsn, source.dsn)
    shape = check_source(source.dsn, spec, pattern.value)  # before the scratch is replaced

    def run(scratch: str, recording: str, on_snapshot: Snapshots | None) -> dict[str, Any]:
        request = RehearsalRequest(
            pattern=pattern.value,
            source_dsn=source.dsn,
            scratch_dsn=scratch,
            recording_dsn=recording,
            spec=spec,
            rows=rows,
            seconds=seconds,
            measure_s=measure_seconds,
            sample=sample,
        )
        return run_rehearsal(request, on_snapshot=on_snapshot, output_dir=output_dir, shape=shape)

    title = f"outbox-migrate rehearsal: {pattern.value.upper()}"
    result = run_live(run, base, SCRATCH_DB, output, title, render_rehearsal_report)
    if result.get("interrupted"):
        from outbox_migrate.cli.exits import set_interrupt_note

        set_interrupt_note("writers and relays stopped; the source was not touched")
        raise KeyboardInterrupt
    if result["lost"]:
        raise OutboxMigrateError(
            f"the rehearsal lost {result['lost']} messages (see the report above): do not "
            "run this pattern on the live table before the cause is known"
        )


def _scratch_server(scratch_dsn: str, source_dsn: str) -> str:
    """The scratch server's DSN (the embedded one started if asked); refused when one of the
    databases rehearse replaces would be the source's own."""
    from psycopg.conninfo import conninfo_to_dict

    from outbox_migrate.db import resolve_embedded
    from outbox_migrate.errors import UsageError

    base = resolve_embedded(scratch_dsn)
    src, dst = conninfo_to_dict(source_dsn), conninfo_to_dict(base)
    same_server = (src.get("host"), src.get("port")) == (dst.get("host"), dst.get("port"))
    if same_server and str(src.get("dbname") or "").startswith(f"{SCRATCH_DB}_"):
        raise UsageError(
            f"the source database is {src.get('dbname')!r}, named like a rehearsal's own "
            "scratch database; rehearse a real outbox, or use another --scratch-dsn"
        )
    return base
