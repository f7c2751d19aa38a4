"""Options shared by several commands, and turning them into `Settings`: every value is
validated by `config.load_settings` before a command does any work."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import MISSING, Field, fields
from enum import StrEnum
from functools import wraps
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from outbox_migrate.config import ID_KINDS, OutboxSpec, Settings, load_settings

_F = TypeVar("_F", bound=Callable[..., Any])
NAMES_PARAMETER = "names"

NAME_HELP: dict[str, str] = {
    "schema": "Schema of the outbox tables",
    "table": "The flat outbox table",
    "partitioned_table": "The new partitioned table",
    "unpublished_partition": "Partition of the unpublished rows (FOR VALUES IN (NULL))",
    "published_partition": "The DEFAULT partition",
    "id_column": "Identity column",
    "published_column": "Publication marker column (a timestamp or a flag)",
    "unpublished_value": "A flag marker's unpublished value ('' = its DEFAULT)",
    "published_value": "The value the relay sets on a flag marker ('' = 1 or true)",
    "status_column": "A status column the relay sets on publish too ('' if none)",
    "status_published_value": "The value the relay sets status_column to",
    "id_headroom": "Gap between the old max(id) and the new identity START",
    "created_column": "Creation timestamp column ('' if none)",
    "payload_column": "Message body column",
    "key_column": "Broker key column ('' if none)",
    "event_type_column": "Column sent as the event-type header ('' if none)",
    "headers_column": "Column of JSON objects (jsonb, json, text) sent as headers ('' if none)",
    "metadata_columns": "Further columns sent as headers, comma-separated",
    "id_kind": f"Where ids come from: {' or '.join(ID_KINDS)}",
    "order_column": "Claim order for application ids ('' = the id)",
    "accept_lost_unique": "A unique index or constraint whose rule may be lost (see `plan`), "
    "repeatable",
    "unpublished_guard": "Guard unpublished rows against other sessions' DELETEs (on or off)",
}
"""Help for the spec's fields; a field without an entry still gets an option."""

SETTING_HELP: dict[str, str] = {
    "lock_timeout_ms": "lock_timeout of each lock attempt, ms",
    "lock_budget_s": "Total time a step may retry for its locks, s",
    "old_app_name": "application_name (SQL LIKE) of the outgoing app version",
    "gate_window_s": "How long a deploy gate watches the old table for new ids, s",
}

RUNNER_SETTINGS = ("lock_timeout_ms", "lock_budget_s", "old_app_name", "gate_window_s")
"""`plan` reads all four too: its SQL sets the lock timeout."""

PATTERN_SETTINGS = ("old_app_name", "gate_window_s")
"""`status` and `verify` build the pattern's checks, which these two shape."""


def _default_text(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(value) or "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return "''" if value == "" else str(value)


_PYTHON_TYPES: dict[str, Any] = {"int": int, "float": float}


def _name_parameter(field_name: str, field_type: str, default: Any) -> inspect.Parameter:
    flag = "--" + field_name.replace("_", "-")
    described = NAME_HELP.get(field_name) or SETTING_HELP.get(field_name)
    base = described or field_name.replace("_", " ").capitalize()
    help_text = f"{base} [{_default_text(default)}]."
    # A list setting takes the flag repeatedly (or one comma-separated value).
    python_type: Any = _PYTHON_TYPES.get(field_type, list[str] if "tuple" in field_type else str)
    annotation = Annotated[
        python_type | None, typer.Option(flag, help=help_text, show_default=False)
    ]
    return inspect.Parameter(
        field_name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation
    )


def _given(value: Any) -> Any:
    """A flag's value as `load_settings` takes it; None when the flag was not passed (a
    repeatable flag not passed arrives as an empty list, which must not override env/file)."""
    if isinstance(value, list | tuple):
        return ",".join(value) or None
    return value


def _generated_fields(settings: tuple[str, ...]) -> list[Field[Any]]:
    chosen = [f for f in fields(Settings) if f.name in settings]
    unknown = set(settings) - {f.name for f in chosen}
    if unknown:
        raise ValueError(f"not settings: {sorted(unknown)}")
    return [*fields(OutboxSpec), *chosen]


def with_names(command: _F, *, settings: tuple[str, ...] = ()) -> _F:
    """Give `command` one option per `OutboxSpec` field, and one per `Settings` key named in
    `settings` (the commands that read them); it receives those the user passed as
    `names: dict[str, Any]` (pass it on to `settings_from(**names)`)."""
    signature = inspect.signature(command, eval_str=True)
    own = [p for p in signature.parameters.values() if p.name != NAMES_PARAMETER]
    taken = {p.name for p in own}
    added = [
        _name_parameter(f.name, str(f.type), f.default if f.default is not MISSING else None)
        for f in _generated_fields(settings)
        if f.name not in taken
    ]

    @wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        # In the spec's field order, so advice built from them reads the same every time.
        given = {p.name: _given(kwargs.pop(p.name, None)) for p in added}
        names = {name: value for name, value in given.items() if value is not None}
        return command(**kwargs, **{NAMES_PARAMETER: names})

    parameters = own + added
    wrapper.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
    del wrapper.__wrapped__  # typer must read our signature, not the original one
    return wrapper  # type: ignore[return-value]


DsnOption = Annotated[
    str | None,
    typer.Option(
        "--dsn",
        help="PostgreSQL DSN (URI or key=value), or 'embedded'. "
        "Default: $OUTBOX_MIGRATE_DSN, then libpq PG* variables.",
        show_default=False,
    ),
]


class OutputFormat(StrEnum):
    text = "text"
    json = "json"


FormatOption = Annotated[
    OutputFormat, typer.Option("--format", help="Output format: text for people, json for tools.")
]


def report(output: OutputFormat, data: Any, *lines: str) -> None:
    from outbox_migrate.cli.console import print_json, text

    if output is OutputFormat.json:
        print_json(data)
        return
    for line in lines:
        text(line)


OptionalOption = Annotated[
    bool, typer.Option(help="Include optional steps (SET NOT NULL, final drops).")
]
ReportDirOption = Annotated[
    Path, typer.Option(help="Where the PNG timeline and the HTML report go.")
]


class Phase(StrEnum):
    """Every phase name the patterns use (each pattern has a subset; the runner says which)."""

    V1 = "V1"
    V2 = "V2"
    V3 = "V3"
    V4 = "V4"
    copy_back = "copy-back"
    original_name = "original-name"
    """Optional (--with-optional): the partitioned table takes the flat table's name."""
    drop_view = "drop-view"
    """Optional (--with-optional): the view under the former name goes."""


OPTIONAL_PHASES = frozenset({Phase.original_name, Phase.drop_view})


def parse_phase(value: str) -> Phase:
    """`--to v2` and `--to V2` alike; shown and refused in the docs' spelling (V2, copy-back)."""
    for phase in Phase:
        if phase.value.lower() == value.strip().lower():
            return phase
    raise typer.BadParameter(f"{value!r} is not one of {', '.join(p.value for p in Phase)}")


ToOption = Annotated[
    Phase,
    typer.Option(
        "--to",
        parser=parse_phase,
        metavar="|".join(p.value for p in Phase),
        help="Phase to reach (V2, V3, V4, copy-back; any case).",
    ),
]


def require_finite(flag: str, value: float | None) -> None:
    """Reject an infinite or NaN number of seconds (0 may mean "off") before any work."""
    import math

    from outbox_migrate.errors import UsageError

    if value is not None and not math.isfinite(value):
        raise UsageError(f"{flag} must be a finite number of seconds, got {value}")


def require_positive(flag: str, value: float | None) -> None:
    """Reject a zero, negative, infinite or NaN number before any work, naming the option."""
    import math

    from outbox_migrate.errors import UsageError

    if value is not None and not (math.isfinite(value) and value > 0):
        raise UsageError(f"{flag} must be a positive number of seconds, got {value}")


def command_line(*words: str, dsn: str | None = None, names: dict[str, Any] | None = None) -> str:
    """A follow-up command for the user to run, carrying the DSN and names they gave (the
    DSN's password masked: printed advice must never leak it)."""
    import shlex

    from outbox_migrate.dsn import mask

    parts = ["outbox-migrate", *words]
    for key, value in (names or {}).items():
        shown = ",".join(value) if isinstance(value, tuple | list) else str(value)
        parts += ["--" + key.replace("_", "-"), shlex.quote(shown)]
    if dsn:
        parts += ["--dsn", shlex.quote(mask(dsn))]
    return " ".join(parts)


def settings_from(**flags: Any) -> Settings:
    return load_settings({k: v for k, v in flags.items() if v is not None})


def require_dsn(flag: str | None) -> str:
    from outbox_migrate.dsn import resolve
    from outbox_migrate.errors import UsageError

    resolved = resolve(flag)
    if resolved is None:
        raise UsageError("no database given: pass --dsn, set OUTBOX_MIGRATE_DSN or PG* variables")
    return resolved.dsn
