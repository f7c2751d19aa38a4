"""`outbox-migrate config`: show the names and settings in force, and where each came from."""

from __future__ import annotations

from typing import Any

import typer

from outbox_migrate.cli.options import (
    RUNNER_SETTINGS,
    FormatOption,
    OutputFormat,
    settings_from,
    with_names,
)


def register(app: typer.Typer) -> None:
    app.command(
        "config",
        help="Show the configuration in force and where each value came from.\n\n"
        "Example: outbox-migrate config --table events_outbox --format json",
    )(with_names(config, settings=RUNNER_SETTINGS))


def config(
    output: FormatOption = OutputFormat.text,
    *,
    names: dict[str, Any],
) -> None:
    from dataclasses import asdict

    settings = settings_from(**names)
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
