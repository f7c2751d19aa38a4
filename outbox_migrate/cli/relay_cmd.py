"""`outbox-migrate relay`: run the publisher (claim → publish → mark) until stopped.

A thin shell over `outbox_migrate.relay.worker.Relay`: parse options, build the sink factory,
wire SIGTERM/SIGINT to a graceful stop, and expose metrics when asked. Messages go to the sink
(stdout for `--sink stdout`); log lines go to stderr.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, TypeVar

import typer

from outbox_migrate.cli.options import (
    DsnOption,
    IdColumnOption,
    PartitionedOption,
    PublishedColumnOption,
    PublishedOption,
    SchemaOption,
    TableOption,
    UnpublishedOption,
)

_E = TypeVar("_E", bound=Enum)
RELAY_SWITCH_INTERVAL_S = 0.0005

HELP = (
    "Publish the outbox to a broker: claim a batch, publish it, wait for the broker's "
    "acknowledgement, mark it published. At-least-once; SIGTERM finishes the batch in flight."
    "\n\nModes: partitioned (steady state), switching (V2 of HOP/HOPER/HOPIA: drain the flat "
    "table, then switch once no writer can insert into it), flat (a traditional outbox)."
    "\n\nExample: outbox-migrate relay --sink kafka --sink-url 127.0.0.1:9092 --target orders "
    "--mode partitioned --workers 4"
    "\n\nExample: outbox-migrate relay --sink stdout --until-empty --dsn postgresql://app@db/app"
)


def register(app: typer.Typer) -> None:
    app.command("relay", help=HELP)(relay)


def relay(
    sink: Annotated[
        str,
        typer.Option(
            help="stdout, kafka, rabbitmq, nats, redis, http, or module:callable for your own."
        ),
    ],
    mode: Annotated[str, typer.Option(help="partitioned, switching or flat.")] = "partitioned",
    dsn: DsnOption = None,
    until_empty: Annotated[
        bool, typer.Option("--until-empty", help="Exit 0 once nothing is left to publish.")
    ] = False,
    batch_size: Annotated[int, typer.Option(help="Rows per claim.")] = 500,
    workers: Annotated[int, typer.Option(help="Concurrent claimers in this process.")] = 1,
    shards: Annotated[
        int | None,
        typer.Option(help="Shards across all relay processes of this outbox [max(8, workers)]."),
    ] = None,
    ordering: Annotated[
        str,
        typer.Option(help="none (shard by id), key (per-key order), global (one claimer)."),
    ] = "none",
    sink_url: Annotated[
        str | None, typer.Option(help="Broker address (bootstrap servers, amqp://, nats://, …).")
    ] = None,
    target: Annotated[
        str, typer.Option(help="Topic / routing key / subject / stream name.")
    ] = "outbox",
    sink_timeout: Annotated[float, typer.Option(help="Seconds to wait for acks.")] = 10.0,
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
    channel: Annotated[str, typer.Option(help="NOTIFY channel.")] = "outbox_migrate_relay",
    max_attempts: Annotated[
        int, typer.Option(help="Rejections before a message goes to the dead-letter table.")
    ] = 5,
    dead_letter_table: Annotated[
        str, typer.Option(help="Dead-letter table.")
    ] = "outbox_dead_letter",
    switch_gate: Annotated[
        str,
        typer.Option(help="privilege (INSERT revoked) or sessions (old app disconnected)."),
    ] = "privilege",
    old_app_name: Annotated[
        str | None, typer.Option(help="application_name LIKE pattern of the old app version.")
    ] = None,
    shutdown_timeout: Annotated[
        float, typer.Option(help="Seconds a stop waits for the batch in flight.")
    ] = 10.0,
    metrics_port: Annotated[
        int | None, typer.Option(help="Serve /metrics and /healthz on this port.")
    ] = None,
    metrics_host: Annotated[str, typer.Option(help="Address for /metrics.")] = "127.0.0.1",
    log_level: Annotated[str, typer.Option(help="Log level for stderr.")] = "warning",
    schema: SchemaOption = None,
    table: TableOption = None,
    partitioned_table: PartitionedOption = None,
    unpublished_partition: UnpublishedOption = None,
    published_partition: PublishedOption = None,
    id_column: IdColumnOption = None,
    published_column: PublishedColumnOption = None,
) -> None:
    import logging
    import signal
    import sys

    from outbox_migrate.cli.options import settings_from
    from outbox_migrate.dsn import resolve
    from outbox_migrate.errors import UsageError
    from outbox_migrate.relay import metrics as relay_metrics
    from outbox_migrate.relay import sinks
    from outbox_migrate.relay.options import Mode, Ordering, RelayOptions, SwitchGate
    from outbox_migrate.relay.worker import Relay

    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(logging, log_level.upper(), logging.WARNING),
        format="%(asctime)s %(levelname)s %(message)s",
    )
    resolved = resolve(dsn)
    if resolved is None:
        raise UsageError("no database given: pass --dsn, set OUTBOX_MIGRATE_DSN or PG* variables")
    settings = settings_from(
        schema=schema,
        table=table,
        partitioned_table=partitioned_table,
        unpublished_partition=unpublished_partition,
        published_partition=published_partition,
        id_column=id_column,
        published_column=published_column,
        old_app_name=old_app_name,
    )
    options = RelayOptions(
        mode=_choice(Mode, mode, "--mode"),
        batch_size=batch_size,
        workers=workers,
        shards=shards,
        ordering=_choice(Ordering, "global_" if ordering == "global" else ordering, "--ordering"),
        until_empty=until_empty,
        poll_interval_s=poll_interval,
        listen=listen,
        channel=channel,
        shutdown_timeout_s=shutdown_timeout,
        max_attempts=max_attempts,
        dead_letter_table=dead_letter_table,
        key_column=key_column,
        event_type_column=event_type_column,
        switch_gate=_choice(SwitchGate, switch_gate, "--switch-gate"),
        old_app_name=settings.old_app_name,
    )
    extra: dict[str, str] = {}
    for item in sink_option or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--sink-option: expected KEY=VALUE, got {item!r}")
        extra[key] = value
    # The sink is told the ordering so a concurrent one (http) keeps exactly what it promises.
    config = sinks.SinkConfig(
        url=sink_url, target=target, timeout_s=sink_timeout, extra=extra, ordering=options.ordering
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
        # change this global (measured: 2 workers 150k → 200k rows/s, bench/relay.py).
        sys.setswitchinterval(RELAY_SWITCH_INTERVAL_S)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda _signum, _frame: runner.stop())
    try:
        runner.run()
    finally:
        if server is not None:
            server.shutdown()


def _choice(enum: type[_E], value: str, flag: str) -> _E:
    from outbox_migrate.errors import UsageError

    try:
        return enum[value]
    except KeyError:
        names = ", ".join(n.rstrip("_") for n in enum.__members__)
        raise UsageError(f"{flag}: {value!r} is not one of {names}") from None
