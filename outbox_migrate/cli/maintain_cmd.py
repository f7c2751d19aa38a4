"""`outbox-migrate maintain`: autovacuum settings, unpublished-index bloat and REINDEX,
retention; `--once` for cron (exit codes: docs/maintenance.md), else a pass every `--interval`."""

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

if TYPE_CHECKING:
    from outbox_migrate.jobs.maintain import MaintenanceReport


def register(app: typer.Typer) -> None:
    app.command(
        "maintain",
        help="Keep the partitioned outbox healthy: the spec's autovacuum settings on the "
        "published partition, the unpublished partition's index bloat measured and rebuilt "
        "with REINDEX CONCURRENTLY above a threshold, optional retention. Loops unless --once."
        "\n\nExample: outbox-migrate maintain --once --format json --dsn $DATABASE_URL",
    )(with_names(maintain))


def maintain(
    dsn: DsnOption = None,
    once: Annotated[bool, typer.Option("--once", help="One pass, then exit (for cron).")] = False,
    interval: Annotated[
        float, typer.Option(min=1, help="Seconds between passes in loop mode.")
    ] = 300.0,
    bloat_threshold: Annotated[
        float,
        typer.Option(min=0, max=100, help="Rebuild above this bloat (%)."),
    ] = 50.0,
    bloat_method: Annotated[
        str,
        typer.Option(help="auto (pgstattuple when available), pgstattuple or estimate."),
    ] = "auto",
    no_reindex: Annotated[
        bool, typer.Option("--no-reindex", help="Measure and report, never rebuild.")
    ] = False,
    no_autovacuum: Annotated[
        bool, typer.Option("--no-autovacuum", help="Check the settings, never change them.")
    ] = False,
    max_xact_age: Annotated[
        float,
        typer.Option(min=0, help="Refuse to rebuild while a transaction is older."),
    ] = 60.0,
    retention_days: Annotated[
        float | None,
        typer.Option(min=0, help="Delete rows published longer ago than this."),
    ] = None,
    retention_rate: Annotated[
        float, typer.Option(min=1, help="Ceiling on deleted rows/s.")
    ] = 50_000.0,
    output: FormatOption = OutputFormat.text,
    *,
    names: dict[str, Any],
) -> None:
    from outbox_migrate.cli import signals

    # First, in loop mode: SIGINT and SIGTERM are the service's normal stop from the command's
    # first statement — the pass in flight finishes (a REINDEX CONCURRENTLY cut short would
    # leave an invalid index behind), then it exits 0.
    stopping = None if once else signals.GracefulStop()
    import threading
    from datetime import timedelta

    from outbox_migrate.db import connect
    from outbox_migrate.errors import MaintenanceProblems, OutboxMigrateError, UsageError
    from outbox_migrate.jobs.maintain import MaintenanceOptions, maintain_loop, maintain_once

    if bloat_method not in ("auto", "pgstattuple", "estimate"):
        raise UsageError(f"--bloat-method: auto, pgstattuple or estimate, not {bloat_method!r}")
    settings = settings_from(**names)
    target = require_dsn(dsn)
    options = MaintenanceOptions(
        apply_autovacuum=not no_autovacuum,
        bloat_threshold_pct=bloat_threshold,
        bloat_method=bloat_method,  # type: ignore[arg-type]  # checked above
        reindex=not no_reindex,
        max_xact_age_s=max_xact_age,
        retention=timedelta(days=retention_days) if retention_days is not None else None,
        retention_max_rows_per_s=retention_rate,
    )
    as_json = output is OutputFormat.json
    if once:
        with connect(target) as conn:
            report = maintain_once(conn, settings.spec, options)
        _show(report, as_json)
        if report.problems:
            failed = any(o.status == "failed" for o in report.indexes)
            raise MaintenanceProblems(report.problems, failed=failed)
        return

    stop = threading.Event()
    if stopping is not None and stopping.attach(stop.set):
        return  # stopped while starting: nothing begun

    def on_error(exc: OutboxMigrateError) -> None:
        from outbox_migrate.cli.console import err

        err().print(f"outbox-migrate: maintain: {exc}", markup=False)

    maintain_loop(
        target,
        settings.spec,
        options,
        interval_s=interval,
        on_report=lambda report: _show(report, as_json, compact=True),
        on_error=on_error,
        stop=stop,
    )


def _show(report: MaintenanceReport, as_json: bool, *, compact: bool = False) -> None:
    if as_json:
        from dataclasses import asdict

        from outbox_migrate.cli.console import print_json

        print_json({**asdict(report), "problems": report.problems}, indent=None if compact else 2)
        return
    from outbox_migrate.cli.console import table, text
    from outbox_migrate.cli.wording import count

    text(f"maintenance pass at {report.started_at} ({report.seconds:.1f}s)")
    for av in report.autovacuum:
        state = "applied" if av.applied else ("ok" if av.ok else "differs")
        text(f"  autovacuum on {av.table}: {state}" + (f" ({av.error})" if av.error else ""))
    if report.time_partitions is not None:
        tp = report.time_partitions
        text(f"  time partitions of {tp.table}: created {', '.join(tp.created) or 'none'};"
             f" dropped {', '.join(tp.dropped) or 'none'}")  # fmt: skip
    rows = []
    for o in report.indexes:
        after = f"{o.after.bloat_pct:.1f}" if o.after else ""
        rows.append((o.index, o.before.method, f"{o.before.size_bytes:,}",
                     f"{o.before.bloat_pct:.1f}", after, o.status, o.message))  # fmt: skip
    table(f"indexes of {report.unpublished}",
          ["index", "method", "bytes", "bloat %", "after %", "status", "note"], rows)  # fmt: skip
    if report.retention is not None:
        r = report.retention
        done = (f"deleted {count(r.deleted_rows, 'row')} in {count(r.batches, 'batch', 'batches')}"
                f" ({r.seconds:.1f}s)")  # fmt: skip
        text(f"  retention on {r.table}: " + (f"skipped ({r.skipped})" if r.skipped else done))
    for note in report.notes:
        text(f"  note: {note}")
    for denied in report.denied:
        text(f"  not done: {denied}")
