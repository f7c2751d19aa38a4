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


def config(output: FormatOption = OutputFormat.text, *, names: dict[str, Any]) -> None:
    from dataclasses import asdict

    settings = settings_from(**names)
    values = asdict(settings.spec) | {key: getattr(settings, key) for key in RUNNER_SETTINGS}
    source = {key: settings.sources.get(key, "default") for key in values}
    if output is OutputFormat.json:
        from outbox_migrate.cli.console import print_json

        print_json({key: {"value": v, "source": source[key]} for key, v in values.items()})
        return
    from outbox_migrate.cli.console import table

    rows = [(key, v, source[key]) for key, v in values.items()]
    table("outbox-migrate configuration", ["key", "value", "source"], rows)
