"""`outbox-migrate relay`: a thin shell over `relay.worker.Relay` and `relay.cdc.relay.CdcRelay`
(options, the sink factory, a graceful stop, metrics, `--drop-slot`). Logs go to stderr."""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any, get_type_hints

import typer

from outbox_migrate.cli.options import NAMES_PARAMETER, DsnOption, with_names
from outbox_migrate.relay.options import (
    DEFAULT_CDC_LINGER_S,
    LINGER_S,
    CdcOptions,
    Mode,
    Ordering,
    RelayOptions,
    SwitchGate,
    check_name,
)

if TYPE_CHECKING:
    from http.server import ThreadingHTTPServer

    from outbox_migrate.config import OutboxSpec, Settings
    from outbox_migrate.relay.cdc.relay import CdcRelay
    from outbox_migrate.relay.sinks import SinkConfig
    from outbox_migrate.relay.worker import Relay

RELAY_SWITCH_INTERVAL_S = 0.0005

HELP = (
    "Publish the outbox to a broker: claim a batch, publish it, wait for the broker's "
    "acknowledgement, mark it published. At-least-once; SIGTERM finishes the batch in flight."
    "\n\nModes: partitioned (steady state), switching (V2 of HOP/HOPER/HOPIA: drain the flat "
    "table, then switch once no writer can insert into it), flat (a traditional outbox)."
    "\n\nBrokers and their options (--sink kafka --sink-url HOST:9092 --target orders, …): "
    "docs/relay.md."
    "\n\nExample: outbox-migrate relay --sink stdout --until-empty --dsn $DATABASE_URL"
)


class ModeChoice(StrEnum):
    partitioned = "partitioned"
    switching = "switching"
    flat = "flat"
    cdc = "cdc"


class LogLevel(StrEnum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


@dataclass(frozen=True)
class RelayFlags:
    """Every flag of `relay`, in --help order."""

    sink: Annotated[
        str | None,
        typer.Option(
            help="stdout, kafka, rabbitmq, nats, redis, http, or module:callable for your own."
        ),
    ] = None
    mode: Annotated[
        ModeChoice, typer.Option(help="partitioned, switching, flat, or cdc (stream from the WAL).")
    ] = ModeChoice.partitioned
    dsn: DsnOption = None
    until_empty: Annotated[
        bool,
        typer.Option(
            "--until-empty",
            "--once",
            help="Exit 0 once nothing is left to publish (--once, as for maintain, is the same).",
        ),
    ] = False
    batch_size: Annotated[int, typer.Option(help="Rows per claim.", min=1)] = 500
    workers: Annotated[int, typer.Option(help="Concurrent claimers in this process.", min=1)] = 1
    shards: Annotated[
        int | None,
        typer.Option(
            help="Shards across all relay processes of this outbox [max(8, workers)].", min=1
        ),
    ] = None
    ordering: Annotated[
        Ordering,
        typer.Option(help="none (shard by id), key (per-key order), global (one claimer)."),
    ] = Ordering.none
    sink_url: Annotated[
        str | None, typer.Option(help="Broker address (bootstrap servers, amqp://, nats://, …).")
    ] = None
    target: Annotated[str, typer.Option(help="Topic / routing key / subject / stream name.")] = (
        "outbox"
    )
    sink_timeout: Annotated[float, typer.Option(help="Seconds to wait for acks (> 0).")] = 10.0
    max_message_bytes: Annotated[
        int | None,
        typer.Option(
            help="Reject a message whose body is larger, before sending it (dead-letter table "
            "after --max-attempts) [the broker's usual limit: kafka 1000000, rabbitmq 128 MiB, "
            "nats the server's max_payload, redis its proto-max-bulk-len; http, stdout: none].",
            min=1,
            show_default=False,
        ),
    ] = None
    sink_option: Annotated[
        list[str] | None,
        typer.Option(
            help="KEY=VALUE for the sink, repeatable: exchange (rabbitmq), stream (nats), "
            "maxlen (redis), retries, concurrency, batch (http), librdkafka settings such as "
            "linger.ms (kafka)."
        ),
    ] = None
    key_column: Annotated[
        str | None, typer.Option(help="Column used as the broker key [message_key].")
    ] = None
    event_type_column: Annotated[
        str | None, typer.Option(help="Column sent as the event-type header [event_type].")
    ] = None
    poll_interval: Annotated[float, typer.Option(help="Seconds between idle polls.")] = 1.0
    listen: Annotated[bool, typer.Option(help="Wake on NOTIFY.")] = True
    linger_ms: Annotated[
        float | None,
        typer.Option(
            help="After a small batch, wait this long for more rows [polling: 5]. cdc: once "
            "a transaction arrives, sleep this long (and, while the stream stays busy, "
            "between batches) before reading what arrived and publishing what is complete "
            "as one batch: fewer wake-ups (CPU) for up to this much latency; a full batch "
            "never waits; 0 publishes at once [cdc: 2].",
            show_default=False,
        ),
    ] = None
    read_ahead: Annotated[
        bool,
        typer.Option(
            help="While a backlog fills every batch, claim the next batch on a second session "
            "while one is published (one more connection per worker)."
        ),
    ] = True
    install_notify: Annotated[
        bool,
        typer.Option(
            "--install-notify",
            help="Install the wake-up trigger on the partitioned outbox first (plain INSERTs "
            "then wake the relay; docs/relay.md).",
        ),
    ] = False
    channel: Annotated[str, typer.Option(help="NOTIFY channel.")] = "outbox_migrate_relay"
    max_attempts: Annotated[
        int, typer.Option(help="Rejections before a message goes to the dead-letter table.", min=1)
    ] = 5
    dead_letter_table: Annotated[str, typer.Option(help="Dead-letter table.")] = (
        "outbox_dead_letter"
    )
    switch_gate: Annotated[
        SwitchGate,
        typer.Option(help="privilege (INSERT revoked) or sessions (old app disconnected)."),
    ] = SwitchGate.privilege
    old_app_name: Annotated[
        str | None, typer.Option(help="application_name LIKE pattern of the old app version.")
    ] = None
    shutdown_timeout: Annotated[
        float, typer.Option(help="Seconds a stop waits for the batch in flight.")
    ] = 10.0
    session_timeout: Annotated[
        float | None,
        typer.Option(
            help="Seconds after which PostgreSQL drops a silent relay session and its shards "
            "move (keepalives, tcp_user_timeout); 0 = OS defaults, no fencing "
            "[max(12, sink timeout + 2)]."
        ),
    ] = None
    metrics_port: Annotated[
        int | None, typer.Option(help="Serve /metrics and /healthz on this port.", min=1, max=65535)
    ] = None
    metrics_host: Annotated[str, typer.Option(help="Address for /metrics.")] = "127.0.0.1"
    log_level: Annotated[LogLevel, typer.Option(help="Log level for stderr.")] = LogLevel.warning
    slot: Annotated[str, typer.Option(help="cdc: the relay's replication slot.")] = (
        "outbox_migrate_cdc"
    )
    publication: Annotated[
        str, typer.Option(help="cdc: the publication on the unpublished partition.")
    ] = "outbox_migrate_cdc"
    mark: Annotated[
        bool,
        typer.Option(
            help="cdc: move delivered rows to the published partition (off: append-only "
            "outbox, retention drops partitions)."
        ),
    ] = True
    mark_interval: Annotated[
        float,
        typer.Option(
            help="cdc: seconds acknowledged ids collect before one mark (sent behind the "
            "stream; the slot is confirmed once it committed)."
        ),
    ] = 0.1
    slot_lag_warn_mb: Annotated[
        int, typer.Option(help="cdc: warn (log, /readyz 503) above this much retained WAL.")
    ] = 1024
    failover_slot: Annotated[
        bool, typer.Option(help="cdc: create a failover slot (PostgreSQL 17+).")
    ] = True
    drop_slot: Annotated[
        bool,
        typer.Option(
            "--drop-slot",
            help="Decommission the CDC relay: drop its slot and publication (asks for "
            "confirmation), then exit.",
        ),
    ] = False
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Confirm --drop-slot.")] = False


def register(app: typer.Typer) -> None:
    hints = get_type_hints(RelayFlags, include_extras=True)
    parameters = [
        inspect.Parameter(f.name, _KEYWORD, default=f.default, annotation=hints[f.name])
        for f in fields(RelayFlags)
    ]

    def command(**given: Any) -> None:
        names = given.pop(NAMES_PARAMETER)
        relay(RelayFlags(**given), names)

    names = inspect.Parameter(NAMES_PARAMETER, inspect.Parameter.KEYWORD_ONLY, annotation=dict)
    command.__signature__ = inspect.Signature([*parameters, names])  # type: ignore[attr-defined]
    app.command("relay", help=HELP)(with_names(command))


_KEYWORD = inspect.Parameter.POSITIONAL_OR_KEYWORD


def relay(flags: RelayFlags, names: dict[str, Any]) -> None:
    from outbox_migrate.cli import signals

    # First: a SIGTERM while the relay starts is its normal stop too (exit 0, nothing begun).
    stopping = None if flags.drop_slot else signals.GracefulStop()
    import logging

    from outbox_migrate.cli.options import require_dsn, settings_from
    from outbox_migrate.errors import UsageError

    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(logging, flags.log_level.value.upper(), logging.WARNING),
        format="%(asctime)s %(levelname)s %(message)s",
    )
    _check_ranges(flags)
    dsn = require_dsn(flags.dsn)
    settings = settings_from(**names, old_app_name=flags.old_app_name)
    # A bad --sink-option is refused before anything connects, in either delivery style.
    config = _sink_config(flags)
    if flags.drop_slot:
        _drop_slot(dsn, settings.spec, flags)
        return
    if flags.sink is None:
        raise UsageError("--sink is required: where should the relay publish?")
    runner, server = _runner(flags, dsn, settings, config)
    assert stopping is not None
    if not stopping.attach(runner.stop):  # else stopped while starting: nothing begun
        try:
            runner.run()
        finally:
            if server is not None:
                server.shutdown()
    if flags.until_empty and stopping.requested:
        _stopped_before_empty()


def _stopped_before_empty() -> None:
    """`--until-empty` promises an empty outbox at exit 0, which a script's next step relies
    on (`relay --once && next-step`): a stop before that exits as the signal (130/143)."""
    from outbox_migrate.cli import exits, signals

    exits.set_interrupt_note(
        "the relay stopped before nothing was left to publish (a batch in flight was "
        "finished first) — re-run the same command to publish the rest"
    )
    raise signals.Terminated() if signals.last() == signals.SIGTERM else KeyboardInterrupt()


def _runner(
    flags: RelayFlags, dsn: str, settings: Settings, config: SinkConfig
) -> tuple[Relay | CdcRelay, ThreadingHTTPServer | None]:
    from outbox_migrate.relay import metrics as relay_metrics
    from outbox_migrate.relay import sinks
    from outbox_migrate.relay.cdc.relay import CdcRelay
    from outbox_migrate.relay.worker import Relay

    assert flags.sink is not None
    options: RelayOptions | CdcOptions
    if flags.mode is ModeChoice.cdc:
        make_sink = sinks.factory(flags.sink, config)
        options = _cdc_options(flags)
    else:
        options = _relay_options(flags, settings.old_app_name)
        # The sink is told the ordering so a concurrent one (http) keeps exactly what it
        # promises.
        make_sink = sinks.factory(flags.sink, _sink_config(flags, options.ordering))
    observer: relay_metrics.PrometheusObserver | None = None
    server = None
    if flags.metrics_port is not None:
        observer = (
            relay_metrics.CdcObserver(options.lag_warn_bytes, options.lag_warn_s)
            if isinstance(options, CdcOptions)
            else relay_metrics.PrometheusObserver()
        )
        server = relay_metrics.serve(observer, flags.metrics_host, flags.metrics_port)
    if isinstance(options, CdcOptions):
        cdc = CdcRelay(dsn, make_sink, spec=settings.spec, options=options, observer=observer)
        return cdc, server
    # The process is the relay's own: its start-up objects may leave the collector's reach.
    runner = Relay(dsn, make_sink, spec=settings.spec, options=options, observer=observer,
                   freeze_gc=True)  # fmt: skip
    if flags.workers > 1:
        # Worker threads alternate between Python work and waiting on PostgreSQL or the
        # broker; with the default 5 ms switch interval a thread whose reply has arrived
        # waits for another thread's time slice. The process is the relay's own, so it may
        # change this global (bench/relay.py, "Concurrent claimers", shows what it buys).
        sys.setswitchinterval(RELAY_SWITCH_INTERVAL_S)
    if flags.install_notify:
        from outbox_migrate.db import connect
        from outbox_migrate.patterns import notify

        with connect(dsn, application_name=runner.application_name) as conn:
            notify.install(conn, settings.spec, flags.channel)
    return runner, server


def _relay_options(flags: RelayFlags, old_app_name: str) -> RelayOptions:
    return RelayOptions(
        mode=Mode(flags.mode.value),
        batch_size=flags.batch_size,
        workers=flags.workers,
        shards=flags.shards,
        ordering=flags.ordering,
        until_empty=flags.until_empty,
        poll_interval_s=flags.poll_interval,
        linger_s=LINGER_S if flags.linger_ms is None else flags.linger_ms / 1000.0,
        read_ahead=flags.read_ahead,
        listen=flags.listen,
        channel=flags.channel,
        shutdown_timeout_s=flags.shutdown_timeout,
        sink_timeout_s=flags.sink_timeout,
        session_timeout_s=flags.session_timeout,
        max_message_bytes=flags.max_message_bytes,
        max_attempts=flags.max_attempts,
        dead_letter_table=flags.dead_letter_table,
        key_column=flags.key_column,
        event_type_column=flags.event_type_column,
        switch_gate=flags.switch_gate,
        old_app_name=old_app_name,
    )


def _cdc_options(flags: RelayFlags) -> CdcOptions:
    return CdcOptions(
        slot=flags.slot,
        publication=flags.publication,
        batch_size=flags.batch_size,
        mark=flags.mark,
        mark_interval_s=flags.mark_interval,
        failover=flags.failover_slot,
        linger_s=DEFAULT_CDC_LINGER_S if flags.linger_ms is None else flags.linger_ms / 1000.0,
        until_caught_up=flags.until_empty,
        lag_warn_bytes=flags.slot_lag_warn_mb * 1024 * 1024,
        max_attempts=flags.max_attempts,
        dead_letter_table=flags.dead_letter_table,
        key_column=flags.key_column,
        event_type_column=flags.event_type_column,
    )


def _drop_slot(dsn: str, spec: OutboxSpec, flags: RelayFlags) -> None:
    """Drop the relay's slot and publication after a clear confirmation (docs/relay.md)."""
    from psycopg import sql

    from outbox_migrate.cli.console import text
    from outbox_migrate.db import connect
    from outbox_migrate.errors import UsageError
    from outbox_migrate.relay.cdc import slot

    check_name("slot", flags.slot)
    check_name("publication", flags.publication)
    with connect(dsn) as conn:
        state = slot.slot_state(conn, flags.slot)
        if state is None:
            streaming = slot.active_relay_slots(conn)
            if streaming:
                # A misspelt --slot must not take a running relay's publication: pgoutput
                # would then skip its rows in silence while it confirmed past them.
                raise UsageError(
                    f"no replication slot {flags.slot}, and slot(s) {', '.join(streaming)} "
                    f"stream from this database now: publication {flags.publication} may be "
                    "theirs; nothing dropped (stop that relay, or name its --slot)"
                )
            text(f"no replication slot {flags.slot}; dropping publication {flags.publication}")
            slot.drop_publication(conn, flags.publication)
            return
        # Refused before the question: only a relay's slot of this database is ours to drop.
        slot.check_droppable(state, conn.info.dbname)
        row = conn.execute(
            sql.SQL("SELECT count(*) FROM {}").format(
                sql.Identifier(spec.schema, spec.unpublished_partition)
            )
        ).fetchone()
        waiting = int(row[0]) if row else 0
        question = (
            f"Drop replication slot {flags.slot} (holding {state.lag_bytes:,} bytes of WAL, "
            f"{'active' if state.active else 'inactive'}) and publication {flags.publication}? "
            f"{waiting:,} rows are still in the unpublished partition; they stay there for "
            "the next relay to publish."
        )
        if not flags.yes:
            if not sys.stdin.isatty():
                raise UsageError(f"{question} Pass --yes to confirm.")
            from outbox_migrate.cli.console import confirm

            if not confirm(question):
                raise typer.Exit(1)
        slot.drop_slot(conn, flags.slot)
        slot.drop_publication(conn, flags.publication)
    text(f"dropped replication slot {flags.slot} and publication {flags.publication}")


def _sink_config(flags: RelayFlags, ordering: Ordering | None = None) -> SinkConfig:
    from outbox_migrate.errors import UsageError
    from outbox_migrate.relay import sinks

    extra: dict[str, str] = {}
    for item in flags.sink_option or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--sink-option: expected KEY=VALUE, got {item!r}")
        extra[key] = value
    return sinks.SinkConfig(
        url=flags.sink_url, target=flags.target, timeout_s=flags.sink_timeout, extra=extra,
        ordering=ordering, max_message_bytes=flags.max_message_bytes,
    )  # fmt: skip


def _check_ranges(flags: RelayFlags) -> None:
    """Values the relay would only trip over at runtime, refused before it starts."""
    from outbox_migrate.cli.options import require_positive
    from outbox_migrate.errors import UsageError

    require_positive("--sink-timeout", flags.sink_timeout)
    require_positive("--poll-interval", flags.poll_interval)
    require_positive("--shutdown-timeout", flags.shutdown_timeout)
    if flags.session_timeout != 0:  # 0: the OS defaults, no fencing (its help)
        require_positive("--session-timeout", flags.session_timeout)
    shards, workers = flags.shards, flags.workers
    if shards is not None and shards < workers:
        raise UsageError(f"--shards {shards} is fewer than --workers {workers}: "
                         f"{workers - shards} workers would never claim anything")  # fmt: skip
