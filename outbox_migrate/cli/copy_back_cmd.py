"""`outbox-migrate copy-back`: HOPER's job — copy, verify, then drop the detached partition."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from outbox_migrate.cli.options import (
    RUNNER_SETTINGS,
    DsnOption,
    FormatOption,
    OutputFormat,
    report,
    require_dsn,
    require_finite,
    settings_from,
    with_names,
)


def register(app: typer.Typer) -> None:
    app.command(
        "copy-back",
        help="HOPER's job after the V4 swap: copy every row of the detached published "
        "partition into the old table in resumable keyset batches, verify counts and per-range "
        "checksums, then drop the source. A failed verification keeps the source and names the "
        "id ranges that differ.\n\n"
        "Example: outbox-migrate copy-back --dsn $DATABASE_URL --rate 50000",
    )(with_names(copy_back, settings=RUNNER_SETTINGS))


def copy_back(
    dsn: DsnOption = None,
    batch_size: Annotated[
        int, typer.Option(min=1, help="Rows per batch (one transaction each).")
    ] = 10_000,
    rate: Annotated[
        float | None,
        typer.Option(min=1, help="Ceiling in rows/s. Default: as fast as impact allows."),
    ] = None,
    no_drop: Annotated[
        bool, typer.Option("--no-drop", help="Copy and verify, but keep the source table.")
    ] = False,
    no_adaptive: Annotated[
        bool,
        typer.Option(
            "--no-adaptive",
            help="Do not back off on replica lag or probe latency (the --rate ceiling still "
            "holds).",
        ),
    ] = False,
    from_start: Annotated[
        bool,
        typer.Option(
            "--from-start",
            help="Ignore the high-water mark and walk the whole source again (re-copies rows "
            "missing from the target; rows present are skipped).",
        ),
    ] = False,
    max_replica_lag: Annotated[
        float,
        typer.Option(min=0, help="Pause while a replica lags more (seconds)."),
    ] = 5.0,
    output: FormatOption = OutputFormat.text,
    *,
    names: dict[str, Any],
) -> None:
    from dataclasses import asdict

    from outbox_migrate.db import connect
    from outbox_migrate.jobs.copy_back import CopyBack, CopyBackOptions
    from outbox_migrate.jobs.throttle import ThrottlePolicy

    require_finite("--max-replica-lag", max_replica_lag)
    settings = settings_from(**names)
    target = require_dsn(dsn)
    options = CopyBackOptions(
        batch_rows=batch_size,
        throttle=ThrottlePolicy(
            rate_rows_per_s=rate, adaptive=not no_adaptive, max_replica_lag_s=max_replica_lag
        ),
        from_start=from_start,
    )
    if _recorded_migration(target, settings) is not None:
        # One path for the job: with a HOPER migration in the ledger, this command is
        # `run --to copy-back` (or, with --no-drop, the copy-back step alone), so the ledger
        # records it whichever entry point ran it, and either can finish the other's work.
        _through_the_runner(target, settings, options, no_drop, output)
        return
    with connect(target) as conn:
        job = CopyBack(conn, settings.spec, options, dsn=target)
        plan = job.plan()
        if plan.state == "done":
            done = {"state": "done", "source": plan.source, "dropped": True}
            report(output, done, f"{plan.source} was already copied back and dropped")
            return
        if output is OutputFormat.text:
            from outbox_migrate.cli.console import copy_progress, text

            if plan.high_water is not None and not from_start:
                text(f"resuming after id {plan.high_water}: {plan.remaining_rows:,} of "
                     f"{plan.source_rows:,} rows left")  # fmt: skip
            text(f"copying {plan.source} → {plan.target}")
            done_before = 0 if from_start else plan.source_rows - plan.remaining_rows
            with copy_progress(plan.source_rows, done_before) as show:
                result = job.run(progress=show, from_start=from_start, plan=plan)
        else:
            result = job.run(from_start=from_start, plan=plan)
        verification = job.verify()
        summary = {
            "source": plan.source,
            "target": plan.target,
            "copy": {**asdict(result), "rows_per_s": round(result.rows_per_s, 1)},
            "verification": {
                "passed": verification.passed,
                "source_rows": verification.source_rows,
                "matched_rows": verification.matched_rows,
                "ranges_checked": verification.ranges_checked,
                "differing_ranges": [r.describe() for r in verification.differing],
            },
            "dropped": False,
        }
        if not verification.passed:
            report(output, summary)  # JSON only: the error below is the line for people
            from outbox_migrate.jobs.copy_back import VerificationFailed

            raise VerificationFailed(
                verification.source, verification.target, list(verification.differing)
            )
        if not no_drop:
            job.drop(verification)
            summary["dropped"] = True
    report(
        output,
        summary,
        f"copied {result.inserted_rows:,} rows ({result.present_rows:,} already present) "
        f"at {result.rows_per_s:,.0f} rows/s; verified {verification.source_rows:,} rows in "
        f"{verification.ranges_checked} ranges; "
        + (f"dropped {plan.source}" if summary["dropped"] else f"kept {plan.source} (--no-drop)"),
    )


def _recorded_migration(dsn: str, settings: Any) -> object | None:
    """The table's HOPER migration in the ledger, if any (read-only)."""
    from outbox_migrate.db import connect
    from outbox_migrate.errors import UsageError
    from outbox_migrate.runner import ledger
    from outbox_migrate.runner.ledger import ledger_exists

    with connect(dsn) as conn:
        if not ledger_exists(conn):
            return None
        active = ledger.active_for_table(conn, settings.spec)
        if active is not None and active.pattern != "hoper":
            raise UsageError(
                f"copy-back is HOPER's job; the active migration of {settings.spec.schema}."
                f"{settings.spec.table} is {active.pattern.upper()} (phase "
                f"{active.current_phase}), which keeps its published rows without one"
            )
        return ledger.latest(conn, settings.spec, "hoper")


def _through_the_runner(
    dsn: str, settings: Any, options: Any, no_drop: bool, output: OutputFormat
) -> None:
    from dataclasses import asdict

    from outbox_migrate.cli.console import runner_events
    from outbox_migrate.runner import Runner

    events = runner_events(json_lines=output is OutputFormat.json)
    with Runner(dsn, settings, "hoper", events=events, copy_back_options=options) as runner:
        if no_drop:
            result = runner.execute_step("hoper.copy-back.copy-back")
        else:
            result = runner.run("copy-back")
    from outbox_migrate.cli.wording import count

    line = (
        f"HOPER copy-back through the migration's ledger: ran {count(len(result.ran), 'step')}, "
        f"adopted {len(result.adopted)}; "
        + ("migration complete" if result.completed else f"at the end of {result.phase}")
    )
    if output is OutputFormat.json:
        from outbox_migrate.cli.console import print_json

        # One line, as `run`'s: the step events before it are JSON lines too.
        print_json({"event": "result", "through": "runner", **asdict(result)}, indent=None)
        return
    report(output, {"through": "runner", **asdict(result)}, line)
