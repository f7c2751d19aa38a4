"""`outbox-migrate relay`: run the publisher (claim → publish → mark) until stopped.

A thin shell over `outbox_migrate.relay.worker.Relay`: parse options, build the sink factory,
wire SIGTERM/SIGINT to a graceful stop, and expose metrics when asked. Messages go to the sink
(stdout for `--sink stdout`); log lines go to stderr.
"""

from __future__ import annotations

from enum import Enum, StrEnum
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from outbox_migrate.cli.options import (
    DsnOption,
    with_names,
)

if TYPE_CHECKING:
    from outbox_migrate.relay.options import Ordering
    from outbox_migrate.relay.sinks import SinkConfig

_E = TypeVar("_E", bound=Enum)
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


class OrderingChoice(StrEnum):
    none = "none"
    key = "key"
    global_ = "global"


class SwitchGateChoice(StrEnum):
    privilege = "privilege"
    sessions = "sessions"


class LogLevel(StrEnum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


def register(app: typer.Typer) -> None:
    app.command("relay", help=HELP)(with_names(relay))


def relay(
    sink: Annotated[
        str | None,
        typer.Option(
            help="stdout, kafka, rabbitmq, nats, redis, http, or module:callable for your own."
        ),
    ] = None,
    mode: Annotated[
        ModeChoice, typer.Option(help="partitioned, switching, flat, or cdc (stream from the WAL).")
    ] = ModeChoice.partitioned,
    dsn: DsnOption = None,
    until_empty: Annotated[
        bool,
        typer.Option(
            "--until-empty",
            "--once",
            help="Exit 0 once nothing is left to publish (--once, as for maintain, is the same).",
        ),
    ] = False,
    batch_size: Annotated[int, typer.Option(help="Rows per claim.", min=1)] = 500,
    workers: Annotated[int, typer.Option(help="Concurrent claimers in this process.", min=1)] = 1,
    shards: Annotated[
        int | None,
        typer.Option(
            help="Shards across all relay processes of this outbox [max(8, workers)].", min=1
        ),
    ] = None,
    ordering: Annotated[
        OrderingChoice,
        typer.Option(help="none (shard by id), key (per-key order), global (one claimer)."),
    ] = OrderingChoice.none,
    sink_url: Annotated[
        str | None, typer.Option(help="Broker address (bootstrap servers, amqp://, nats://, …).")
    ] = None,
    target: Annotated[
        str, typer.Option(help="Topic / routing key / subject / stream name.")
    ] = "outbox",
    sink_timeout: Annotated[float, typer.Option(help="Seconds to wait for acks (> 0).")] = 10.0,
    max_message_bytes: Annotated[
        int | None,
        typer.Option(
            help="Reject a message whose body is larger, before sending it (dead-letter table "
            "after --max-attempts) [the broker's usual limit: kafka 1000000, rabbitmq 128 MiB, "
            "nats the server's max_payload, redis its proto-max-bulk-len; http, stdout: none].",
            min=1,
            show_default=False,
        ),
    ] = None,
    sink_option: Annotated[
        list[str] | None,
        typer.Option(
            help="KEY=VALUE for the sink, repeatable: exchange (rabbitmq), stream (nats), "
            "maxlen (redis), retries, concurrency, batch (http), librdkafka settings such as "
            "linger.ms (kafka)."
        ),
    ] = None,
    key_column: Annotated[
        str | None, typer.Option(help="Column used as the broker key [message_key].")
    ] = None,
    event_type_column: Annotated[
        str | None, typer.Option(help="Column sent as the event-type header [event_type].")
    ] = None,
    poll_interval: Annotated[float, typer.Option(help="Seconds between idle polls.")] = 1.0,
    listen: Annotated[bool, typer.Option("--listen/--no-listen", help="Wake on NOTIFY.")] = True,
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
    ] = None,
    read_ahead: Annotated[
        bool,
        typer.Option(
            "--read-ahead/--no-read-ahead",
            help="While a backlog fills every batch, claim the next batch on a second session "
            "while one is published (one more connection per worker).",
        ),
    ] = True,
    install_notify: Annotated[
        bool,
        typer.Option(
            "--install-notify",
            help="Install the wake-up trigger on the partitioned outbox first (plain INSERTs "
            "then wake the relay; docs/relay.md).",
        ),
    ] = False,
    channel: Annotated[str, typer.Option(help="NOTIFY channel.")] = "outbox_migrate_relay",
    max_attempts: Annotated[
        int, typer.Option(help="Rejections before a message goes to the dead-letter table.", min=1)
    ] = 5,
    dead_letter_table: Annotated[
        str, typer.Option(help="Dead-letter table.")
    ] = "outbox_dead_letter",
    switch_gate: Annotated[
        SwitchGateChoice,
        typer.Option(help="privilege (INSERT revoked) or sessions (old app disconnected)."),
    ] = SwitchGateChoice.privilege,
    old_app_name: Annotated[
        str | None, typer.Option(help="application_name LIKE pattern of the old app version.")
    ] = None,
    shutdown_timeout: Annotated[
        float, typer.Option(help="Seconds a stop waits for the batch in flight.")
    ] = 10.0,
    session_timeout: Annotated[
        float | None,
        typer.Option(
            help="Seconds after which PostgreSQL drops a silent relay session and its shards "
            "move (keepalives, tcp_user_timeout); 0 = OS defaults, no fencing "
            "[max(12, sink timeout + 2)]."
        ),
    ] = None,
    metrics_port: Annotated[
        int | None, typer.Option(help="Serve /metrics and /healthz on this port.", min=1, max=65535)
    ] = None,
    metrics_host: Annotated[str, typer.Option(help="Address for /metrics.")] = "127.0.0.1",
    log_level: Annotated[LogLevel, typer.Option(help="Log level for stderr.")] = LogLevel.warning,
    slot: Annotated[
        str, typer.Option(help="cdc: the relay's replication slot.")
    ] = "outbox_migrate_cdc",
    publication: Annotated[
        str, typer.Option(help="cdc: the publication on the unpublished partition.")
    ] = "outbox_migrate_cdc",
    mark: Annotated[
        bool,
        typer.Option(
            "--mark/--no-mark",
            help="cdc: move delivered rows to the published "
            "partition (off: append-only outbox, retention drops partitions).",
        ),
    ] = True,
    mark_interval: Annotated[
        float,
        typer.Option(
            help="cdc: seconds acknowledged ids collect before one mark (sent behind the "
            "stream; the slot is confirmed once it committed)."
        ),
    ] = 0.1,
    slot_lag_warn_mb: Annotated[
        int, typer.Option(help="cdc: warn (log, /readyz 503) above this much retained WAL.")
    ] = 1024,
    failover_slot: Annotated[
        bool,
        typer.Option(
            "--failover-slot/--no-failover-slot",
            help="cdc: create a failover slot (PostgreSQL 17+).",
        ),
    ] = True,
    drop_slot: Annotated[
        bool,
        typer.Option(
            "--drop-slot",
            help="Decommission the CDC relay: drop its slot and "
            "publication (asks for confirmation), then exit.",
        ),
    ] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Confirm --drop-slot.")] = False,
    *,
    names: dict[str, Any],
) -> None:
    from outbox_migrate.cli import signals

    # First: a SIGTERM while the relay starts is its normal stop too (exit 0, nothing begun).
    stopping = None if drop_slot else signals.GracefulStop()
    import logging
    import sys

    from outbox_migrate.cli.options import settings_from
    from outbox_migrate.dsn import resolve
    from outbox_migrate.errors import UsageError
    from outbox_migrate.relay import metrics as relay_metrics
    from outbox_migrate.relay import sinks
    from outbox_migrate.relay.options import LINGER_S, Mode, Ordering, RelayOptions, SwitchGate
    from outbox_migrate.relay.worker import Relay

    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(logging, log_level.value.upper(), logging.WARNING),
        format="%(asctime)s %(levelname)s %(message)s",
    )
    _check_ranges(sink_timeout, poll_interval, shutdown_timeout, workers, shards)
    resolved = resolve(dsn)
    if resolved is None:
        raise UsageError("no database given: pass --dsn, set OUTBOX_MIGRATE_DSN or PG* variables")
    settings = settings_from(**names, old_app_name=old_app_name)
    # A bad --sink-option is refused before anything connects, in either delivery style.
    config = _sink_config(sink_option, sink_url, target, sink_timeout, max_message_bytes)
    if mode is ModeChoice.cdc or drop_slot:
        _cdc(locals(), resolved.dsn, config)
        return
    if sink is None:
        raise UsageError("--sink is required: where should the relay publish?")
    options = RelayOptions(
        mode=_choice(Mode, mode.value, "--mode"),
        batch_size=batch_size,
        workers=workers,
        shards=shards,
        ordering=_choice(
            Ordering, "global_" if ordering == "global" else ordering.value, "--ordering"
        ),
        until_empty=until_empty,
        poll_interval_s=poll_interval,
        linger_s=LINGER_S if linger_ms is None else linger_ms / 1000.0,
        read_ahead=read_ahead,
        listen=listen,
        channel=channel,
        shutdown_timeout_s=shutdown_timeout,
        sink_timeout_s=sink_timeout,
        session_timeout_s=session_timeout,
        max_message_bytes=max_message_bytes,
        max_attempts=max_attempts,
        dead_letter_table=dead_letter_table,
        key_column=key_column,
        event_type_column=event_type_column,
        switch_gate=_choice(SwitchGate, switch_gate.value, "--switch-gate"),
        old_app_name=settings.old_app_name,
    )
    # The sink is told the ordering so a concurrent one (http) keeps exactly what it promises.
    config = _sink_config(
        sink_option, sink_url, target, sink_timeout, max_message_bytes, options.ordering
    )
    observer: relay_metrics.Observer | None = None
    server = None
    if metrics_port is not None:
        prometheus = relay_metrics.PrometheusObserver()
        server = relay_metrics.serve(prometheus, metrics_host, metrics_port)
        observer = prometheus
    runner = Relay(
        resolved.dsn,
        sinks.factory(sink, config),
        spec=settings.spec,
        options=options,
        observer=observer,
    )
    if workers > 1:
        # Worker threads alternate between Python work and waiting on PostgreSQL or the
        # broker; with the default 5 ms switch interval a thread whose reply has arrived
        # waits for another thread's time slice. The process is the relay's own, so it may
        # change this global (bench/relay.py, "Concurrent claimers", shows what it buys).
        sys.setswitchinterval(RELAY_SWITCH_INTERVAL_S)
    if install_notify:
        from outbox_migrate.db import connect
        from outbox_migrate.patterns import notify

        with connect(resolved.dsn, application_name=runner.application_name) as conn:
            notify.install(conn, settings.spec, channel)
    assert stopping is not None
    if stopping.attach(runner.stop):
        return  # stopped while starting: nothing was claimed
    try:
        runner.run()
    finally:
        if server is not None:
            server.shutdown()


def _cdc(given: dict[str, object], dsn: str, config: SinkConfig) -> None:
    """Hand over to relay_cdc.py: the CDC relay, or decommissioning its slot."""

    from outbox_migrate.cli import relay_cdc
    from outbox_migrate.errors import UsageError
    from outbox_migrate.relay import sinks

    a: dict[str, Any] = given
    args = relay_cdc.CdcArgs(
        slot=a["slot"], publication=a["publication"], mark=a["mark"],
        mark_interval_s=a["mark_interval"], lag_warn_mb=a["slot_lag_warn_mb"],
        failover=a["failover_slot"],
        linger_s=None if a["linger_ms"] is None else a["linger_ms"] / 1000.0,
    )  # fmt: skip
    if a["drop_slot"]:
        relay_cdc.drop_slot(dsn, a["settings"].spec, args, yes=a["yes"])
        return
    if a["sink"] is None:
        raise UsageError("--sink is required: where should the relay publish?")
    metrics = (a["metrics_host"], a["metrics_port"]) if a["metrics_port"] is not None else None
    relay_cdc.run(
        dsn, a["settings"].spec, args, sink_factory=sinks.factory(a["sink"], config),
        batch_size=a["batch_size"], until_empty=a["until_empty"],
        max_attempts=a["max_attempts"], dead_letter_table=a["dead_letter_table"],
        key_column=a["key_column"], event_type_column=a["event_type_column"], metrics=metrics,
        stopping=a["stopping"],
    )  # fmt: skip


def _sink_config(
    options: list[str] | None,
    url: str | None,
    target: str,
    timeout_s: float,
    max_message_bytes: int | None,
    ordering: Ordering | None = None,
) -> SinkConfig:
    """The `SinkConfig` from the command's sink flags, for both delivery styles;
    `--sink-option` must be KEY=VALUE."""
    from outbox_migrate.errors import UsageError
    from outbox_migrate.relay import sinks

    extra: dict[str, str] = {}
    for item in options or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--sink-option: expected KEY=VALUE, got {item!r}")
        extra[key] = value
    return sinks.SinkConfig(
        url=url, target=target, timeout_s=timeout_s, extra=extra, ordering=ordering,
        max_message_bytes=max_message_bytes,
    )  # fmt: skip


def _check_ranges(
    sink_timeout: float,
    poll_interval: float,
    shutdown_timeout: float,
    workers: int,
    shards: int | None,
) -> None:
    """Values the relay would only trip over at runtime, refused before it starts."""
    from outbox_migrate.cli.options import require_positive
    from outbox_migrate.errors import UsageError

    require_positive("--sink-timeout", sink_timeout)
    require_positive("--poll-interval", poll_interval)
    require_positive("--shutdown-timeout", shutdown_timeout)
    if shards is not None and shards < workers:
        raise UsageError(f"--shards {shards} is fewer than --workers {workers}: "
                         f"{workers - shards} workers would never claim anything")  # fmt: skip


def _choice(enum: type[_E], value: str, flag: str) -> _E:
    from outbox_migrate.errors import UsageError

    try:
        return enum[value]
    except KeyError:
        names = ", ".join(n.rstrip("_") for n in enum.__members__)
        raise UsageError(f"{flag}: {value!r} is not one of {names}") from None
