"""`outbox-migrate config`: show the names and settings in force, and where each came from."""

from __future__ import annotations

import typer

from outbox_migrate.cli.options import (
    FormatOption,
    IdColumnOption,
    OutputFormat,
    PartitionedOption,
    PublishedColumnOption,
    PublishedOption,
    SchemaOption,
    TableOption,
    UnpublishedOption,
    settings_from,
)


def register(app: typer.Typer) -> None:
    app.command(
        "config",
        help="Show the configuration in force and where each value came from.\n\n"
        "Example: outbox-migrate config --table events_outbox --format json",
    )(config)


def config(
    schema: SchemaOption = None,
    table: TableOption = None,
    partitioned_table: PartitionedOption = None,
    unpublished_partition: UnpublishedOption = None,
    published_partition: PublishedOption = None,
    id_column: IdColumnOption = None,
    published_column: PublishedColumnOption = None,
    output: FormatOption = OutputFormat.text,
) -> None:
    from dataclasses import asdict

    settings = settings_from(
        schema=schema,
        table=table,
        partitioned_table=partitioned_table,
        unpublished_partition=unpublished_partition,
        published_partition=published_partition,
        id_column=id_column,
        published_column=published_column,
    )
    values = asdict(settings.spec)
    values.update(
        lock_timeout_ms=settings.lock_timeout_ms,
        lock_budget_s=settings.lock_budget_s,
        old_app_name=settings.old_app_name,
        gate_window_s=settings.gate_window_s,
    )
    if output is OutputFormat.json:
        from outbox_migrate.cli.console import print_json

        print_json(
            {
                key: {"value": value, "source": settings.sources.get(key, "default")}
                for key, value in values.items()
            }
        )
        return
    from outbox_migrate.cli.console import table as print_table

    rows = [(k, v, settings.sources.get(k, "default")) for k, v in values.items()]
    print_table("outbox-migrate configuration", ["key", "value", "source"], rows)
