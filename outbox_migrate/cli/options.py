"""Options shared by several commands, and turning them into `Settings`.

Only the options the user actually passed are forwarded (None = not given), so environment
variables and config files keep their place in the precedence order.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

import typer

from outbox_migrate.config import Settings, load_settings
from outbox_migrate.dsn import ResolvedDsn, resolve

DsnOption = Annotated[
    str | None,
    typer.Option(
        "--dsn",
        help="PostgreSQL DSN (URI or key=value), or 'embedded'. "
        "Default: $OUTBOX_MIGRATE_DSN, then libpq PG* variables.",
        show_default=False,
    ),
]
SchemaOption = Annotated[str | None, typer.Option(help="Schema of the outbox tables [public].")]
TableOption = Annotated[str | None, typer.Option(help="The flat outbox table [outbox].")]
PartitionedOption = Annotated[
    str | None, typer.Option(help="The new partitioned table [outbox_new].")
]
UnpublishedOption = Annotated[
    str | None, typer.Option(help="Partition FOR VALUES IN (NULL) [outbox_unpublished].")
]
PublishedOption = Annotated[
    str | None, typer.Option(help="The DEFAULT partition [outbox_published].")
]
IdColumnOption = Annotated[str | None, typer.Option(help="Identity column [id].")]
PublishedColumnOption = Annotated[
    str | None, typer.Option(help="Publication timestamp column [published_at].")
]


class OutputFormat(StrEnum):
    """Human output or machine-readable JSON."""

    text = "text"
    json = "json"


FormatOption = Annotated[
    OutputFormat, typer.Option("--format", help="Output format: text for people, json for tools.")
]


def settings_from(**flags: Any) -> Settings:
    """Merge the flags the user passed with env, config file and defaults."""
    return load_settings({k: v for k, v in flags.items() if v is not None})


def dsn_from(flag: str | None) -> ResolvedDsn | None:
    return resolve(flag)
