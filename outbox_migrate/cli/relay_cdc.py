"""`outbox-migrate relay --mode cdc` and `relay --drop-slot`: the CLI side of the CDC relay.

Kept apart from relay_cmd.py (the polling relay's options) so that the two delivery styles
can change independently; relay_cmd.py hands over when `--mode cdc` or `--drop-slot` is given.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import typer

from outbox_migrate.config import OutboxSpec
from outbox_migrate.errors import UsageError

if TYPE_CHECKING:
    from outbox_migrate.cli.signals import GracefulStop
    from outbox_migrate.relay.sinks import SinkFactory


@dataclass(frozen=True)
class CdcArgs:
    """The CDC-specific flags, as relay_cmd.py parsed them."""

    slot: str
    publication: str
    mark: bool
    mark_interval_s: float
    lag_warn_mb: int
    failover: bool
    linger_s: float | None = None
    """None: CDC's own default (not the polling relay's)."""


def drop_slot(dsn: str, spec: OutboxSpec, args: CdcArgs, *, yes: bool) -> None:
    """Decommission: drop the relay's slot and publication after a clear confirmation.

    Dropping the slot forgets the stream position: rows committed after the last confirmed
    position and not yet published are still in the unpublished partition, so a polling
    relay (or a new CDC relay, whose first start publishes that backlog) picks them up.
    """
    from psycopg import sql

    from outbox_migrate.cli.console import text
    from outbox_migrate.db import connect
    from outbox_migrate.relay.cdc import slot
    from outbox_migrate.relay.options import check_name

    check_name("slot", args.slot)
    check_name("publication", args.publication)
    with connect(dsn) as conn:
        state = slot.slot_state(conn, args.slot)
        if state is None:
            text(f"no replication slot {args.slot}; dropping publication {args.publication}")
            slot.drop_publication(conn, args.publication)
            return
        # Refused before the question: the slot of another database is not ours to drop.
        slot.check_database(state, conn.info.dbname, "run --drop-slot against that database")
        row = conn.execute(
            sql.SQL("SELECT count(*) FROM {}").format(
                sql.Identifier(spec.schema, spec.unpublished_partition)
            )
        ).fetchone()
        waiting = int(row[0]) if row else 0
        question = (
            f"Drop replication slot {args.slot} (holding {state.lag_bytes:,} bytes of WAL, "
            f"{'active' if state.active else 'inactive'}) and publication {args.publication}? "
            f"{waiting:,} rows are still in the unpublished partition; they stay there for "
            "the next relay to publish."
        )
        if not yes:
            if not sys.stdin.isatty():
                raise UsageError(f"{question} Pass --yes to confirm.")
            from outbox_migrate.cli.console import confirm

            if not confirm(question):
                raise typer.Exit(1)
        slot.drop_slot(conn, args.slot)
        slot.drop_publication(conn, args.publication)
    text(f"dropped replication slot {args.slot} and publication {args.publication}")


def run(
    dsn: str,
    spec: OutboxSpec,
    args: CdcArgs,
    *,
    sink_factory: SinkFactory,
    batch_size: int,
    until_empty: bool,
    max_attempts: int,
    dead_letter_table: str,
    key_column: str | None,
    event_type_column: str | None,
    metrics: tuple[str, int] | None,
    stopping: GracefulStop,
) -> None:
    """Run the CDC relay until SIGTERM/SIGINT (or, with --until-empty, until caught up)."""

    from outbox_migrate.relay import metrics as relay_metrics
    from outbox_migrate.relay.cdc.relay import CdcRelay
    from outbox_migrate.relay.metrics import CdcObserver
    from outbox_migrate.relay.options import DEFAULT_CDC_LINGER_S, CdcOptions

    options = CdcOptions(
        slot=args.slot,
        publication=args.publication,
        batch_size=batch_size,
        mark=args.mark,
        mark_interval_s=args.mark_interval_s,
        failover=args.failover,
        linger_s=DEFAULT_CDC_LINGER_S if args.linger_s is None else args.linger_s,
        until_caught_up=until_empty,
        lag_warn_bytes=args.lag_warn_mb * 1024 * 1024,
        max_attempts=max_attempts,
        dead_letter_table=dead_letter_table,
        key_column=key_column,
        event_type_column=event_type_column,
    )
    observer = None
    server = None
    if metrics is not None:
        observer = CdcObserver(options.lag_warn_bytes, options.lag_warn_s)
        server = relay_metrics.serve(observer, metrics[0], metrics[1])
    runner = CdcRelay(dsn, sink_factory, spec=spec, options=options, observer=observer)
    if stopping.attach(runner.stop):
        return  # stopped while starting: nothing was streamed
    try:
        runner.run()
    finally:
        if server is not None:
            server.shutdown()
