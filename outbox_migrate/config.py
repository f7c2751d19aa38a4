"""Configuration: which tables and columns the migration is about, and how careful to be, from
the sources in docs/configuration.md; every value remembers its source, so an invalid one is
reported in one line. Pure data and parsing; no database access.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from outbox_migrate.errors import ConfigError

ENV_PREFIX = "OUTBOX_MIGRATE_"
CONFIG_FILE = "outbox-migrate.toml"
PYPROJECT_TABLE = "outbox-migrate"
# Environment variables with our prefix that are not configuration keys.
NON_CONFIG_ENV = frozenset(
    {"DSN", "TEST_DSN", "TEST_PG", "CONFIG", "EMBEDDED_DIR", "PG_CACHE", "DEBUG", "FAULT"}
)
MAX_LOCK_TIMEOUT_MS = 2_147_483_647  # lock_timeout is a 32-bit int of milliseconds
MAX_IDENTIFIER_BYTES = 63  # NAMEDATALEN - 1: PostgreSQL silently truncates longer names
DEFAULT_CHANNEL = "outbox_migrate_relay"
"""The channel the wake-up trigger notifies and the relay listens on: here, below both the
pattern step that installs the trigger and the relay, so neither imports the other for it."""


@dataclass(frozen=True)
class OutboxSpec:
    """Names of everything the migration touches, and the column roles; each key's meaning
    is in docs/configuration.md. Defaults are the spec's names."""

    schema: str = "public"
    table: str = "outbox"
    partitioned_table: str = "outbox_new"
    unpublished_partition: str = "outbox_unpublished"
    published_partition: str = "outbox_published"
    id_column: str = "id"
    published_column: str = "published_at"
    unpublished_value: str = ""
    """A flag marker's unpublished value; "" = the column's constant DEFAULT."""
    published_value: str = ""
    """What the relay sets on a flag marker; "" = `1` for an integer, `true` for a boolean."""
    status_column: str = ""
    """A status column beside the marker that the relay's mark sets too ("" = none)."""
    status_published_value: str = ""
    """What the relay sets `status_column` to on publish (e.g. `COMPLETED`)."""
    id_headroom: int = 1_000_000
    """Gap left between the old table's max(id) and the new identity's START."""
    # -- column roles: what each column of the outbox means to the relay, jobs and steps --
    created_column: str = "created_at"
    """Creation timestamp (message age, envelopes); "" when the outbox has none."""
    payload_column: str = "payload"
    """Message body: json, jsonb, text or bytea."""
    key_column: str = "message_key"
    """Broker key (Kafka key, routing key); used only when the table has it, unless set."""
    event_type_column: str = "event_type"
    """Sent as the event-type header; used only when the table has it, unless set."""
    headers_column: str = "headers"
    """A JSON object whose entries become broker headers; used only when the table has it."""
    metadata_columns: tuple[str, ...] = ()
    """Further columns sent as broker headers (`trace_id`, `tenant_id`), name = value."""
    id_kind: str = "database"
    """`database` (an identity or a sequence default) or `application` (uuid, ULID, text)."""
    order_column: str = ""
    """The relay's claim order for application ids; "" = the id itself (uuidv7, ULID)."""
    accept_lost_unique: tuple[str, ...] = ()
    """Unique keys (by name) the partitioned table cannot enforce, whose loss is accepted."""
    unpublished_guard: bool = True
    """Create the unpublished partition's guard (docs/patterns.md, "The unpublished-row
    guard")."""

    @property
    def check_name(self) -> str:
        """The NOT VALID CHECK that lets ATTACH skip its scan (`outbox_published_check`)."""
        return _fit(f"{self.table}_{self.published_column.removesuffix('_at')}_check")

    @property
    def unpublished_index(self) -> str:
        """Index on the unpublished partition's id (`outbox_new_unpublished_id_idx`)."""
        return _fit(f"{self.partitioned_table}_unpublished_{self.id_column}_idx")

    @property
    def copy_trigger(self) -> str:
        """HOPIA's AFTER INSERT trigger on the published partition."""
        return _fit(f"{self.published_partition}_insert")

    @property
    def copy_function(self) -> str:
        return _fit(f"{self.published_partition}_insert_trigger")

    @property
    def guard_function(self) -> str:
        """The unpublished partition's guard: its trigger function and trigger share the name."""
        return _fit(f"{self.unpublished_partition}_guard")

    @property
    def claim_order(self) -> str:
        """The column the relay claims by, oldest first: `order_column`, else the id."""
        return self.order_column or self.id_column

    @property
    def retired_table(self) -> str:
        """COP/HOP's flat table once the partitioned table takes its name (`outbox_retired`)."""
        return _fit(f"{self.table}_retired")

    @property
    def view_use_sequence(self) -> str:
        """The drop-view phase: the sequence every write through the compatibility view (the
        partitioned table's former name) ticks, for the drop gate."""
        return _fit(f"{self.partitioned_table}_view_uses")

    @property
    def view_use_sink(self) -> str:
        """The empty table the view's counting rules insert nothing into (a rule's action
        must be a statement; see patterns/kinds/original_name.py)."""
        return _fit(f"{self.partitioned_table}_view_use_sink")

    @property
    def view_use_function(self) -> str:
        """The function the view's counting rules call: it ticks `view_use_sequence`."""
        return _fit(f"{self.partitioned_table}_view_use_tick")

    @property
    def outbox_name(self) -> str:
        """The outbox's name in messages (CloudEvents `source`, `outbox-table`): the name the
        application's outbox has at both ends of the migration, also for a relay configured
        after the rename, so a message sent again across the rename keeps its (source, id)."""
        if self.table == _fit(f"{self.partitioned_table}_retired"):
            return self.partitioned_table
        return self.table

    @property
    def retired_check(self) -> str:
        """COP/HOP: the NOT VALID CHECK sealing the retired flat table, which no relay reads,
        against unpublished rows (`outbox_is_retired`)."""
        return _fit(f"{self.table}_is_retired")

    @property
    def gate_sequence(self) -> str:
        """Application ids: the sequence the old table's inserts tick, for the deploy gates."""
        return _fit(f"{self.table}_gate_seq")

    @property
    def gate_tick(self) -> str:
        """The gate's trigger on the old table and the function it runs: one name for both."""
        return _fit(f"{self.table}_gate_tick")


@dataclass(frozen=True)
class Settings:
    """Everything configurable: the names (`spec`) and the runner's safety budget."""

    spec: OutboxSpec = field(default_factory=OutboxSpec)
    lock_timeout_ms: int = 200
    """`SET LOCAL lock_timeout` for every step: longer waits queue writers behind us."""
    lock_budget_s: float = 60.0
    """Total time a step may spend retrying lock acquisition before it gives up."""
    old_app_name: str = ""
    """`application_name` pattern (SQL LIKE) of the outgoing application version, if known."""
    gate_window_s: float = 2.0
    """How long a deploy gate watches the old table's sequence for new ids."""
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)
    """Where each non-default key came from (for messages)."""


def _fit(name: str) -> str:
    """Keep derived identifiers within PostgreSQL's limit instead of letting it truncate."""
    return name.encode()[:MAX_IDENTIFIER_BYTES].decode(errors="ignore")


_N = TypeVar("_N", int, float)


def _identifier(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("must be a non-empty string")
    if len(value.encode()) > MAX_IDENTIFIER_BYTES:
        raise ValueError(f"is longer than {MAX_IDENTIFIER_BYTES} bytes")
    if "\x00" in value:
        raise ValueError("contains a NUL byte")
    return value


def _positive(value: Any, kind: type[_N], what: str) -> _N:
    if isinstance(value, bool):
        raise ValueError(f"must be {what}")
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"must be {what}, got {value!r}") from None
    if not number > 0:
        raise ValueError(f"must be positive, got {number}")
    return number


def _positive_int(value: Any) -> int:
    return _positive(value, int, "an integer")


def _positive_float(value: Any) -> float:
    number = _positive(value, float, "a number")
    if number == float("inf"):
        raise ValueError("must be finite (a number of seconds), got inf")
    return number


def _lock_timeout_ms(value: Any) -> int:
    """PostgreSQL's `lock_timeout` is an int of milliseconds: refuse what the server would."""
    number = _positive_int(value)
    if number > MAX_LOCK_TIMEOUT_MS:
        raise ValueError(f"must be at most {MAX_LOCK_TIMEOUT_MS} ms, got {number}")
    return number


def _optional_identifier(value: Any) -> str:
    """An identifier, or "" for "this outbox has no such column"."""
    if value == "":
        return ""
    return _identifier(value)


def _names(what: str) -> Callable[[Any], tuple[str, ...]]:
    """A parser of a TOML list of `what`, or a comma-separated string (environment, flag)."""

    def parse(value: Any) -> tuple[str, ...]:
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        if not isinstance(value, list | tuple):
            raise ValueError(f"must be a list of {what}")
        return tuple(_identifier(item) for item in value)

    return parse


ID_KINDS = ("database", "application")


def _id_kind(value: Any) -> str:
    if value not in ID_KINDS:
        raise ValueError(f"must be one of {', '.join(ID_KINDS)}, got {value!r}")
    return str(value)


_TRUE = frozenset({"true", "on", "yes", "1"})
_FALSE = frozenset({"false", "off", "no", "0"})


def _on_off(value: Any) -> bool:
    """A TOML boolean, or a word from an environment variable or a flag (`off`, `false`)."""
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower() if isinstance(value, str | int) else ""
    if word in _TRUE | _FALSE:
        return word in _TRUE
    raise ValueError(f"must be on or off (true or false), got {value!r}")


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("must be a string")
    return value


_SPEC_KEYS: dict[str, Callable[[Any], Any]] = {
    "schema": _identifier,
    "table": _identifier,
    "partitioned_table": _identifier,
    "unpublished_partition": _identifier,
    "published_partition": _identifier,
    "id_column": _identifier,
    "published_column": _identifier,
    "unpublished_value": _text,
    "published_value": _text,
    "status_column": _optional_identifier,
    "status_published_value": _text,
    "id_headroom": _positive_int,
    "created_column": _optional_identifier,
    "payload_column": _identifier,
    "key_column": _optional_identifier,
    "event_type_column": _optional_identifier,
    "headers_column": _optional_identifier,
    "metadata_columns": _names("column names"),
    "id_kind": _id_kind,
    "order_column": _optional_identifier,
    "accept_lost_unique": _names("index or constraint names"),
    "unpublished_guard": _on_off,
}
_SETTINGS_KEYS: dict[str, Callable[[Any], Any]] = {
    "lock_timeout_ms": _lock_timeout_ms,
    "lock_budget_s": _positive_float,
    "old_app_name": _text,
    "gate_window_s": _positive_float,
}
KEYS = frozenset(_SPEC_KEYS) | frozenset(_SETTINGS_KEYS)
_UNKNOWN_KEY = f"unknown key; known keys: {', '.join(sorted(KEYS))}"


def _from_files(cwd: Path) -> tuple[dict[str, Any], str]:
    """Read `outbox-migrate.toml`, else `[tool.outbox-migrate]` from pyproject.toml."""
    explicit = os.environ.get(ENV_PREFIX + "CONFIG")
    candidates = [Path(explicit)] if explicit else [cwd / CONFIG_FILE]
    for path in candidates:
        if path.is_file():
            return _load_toml(path), str(path)
        if explicit:
            raise ConfigError("config", ENV_PREFIX + "CONFIG", f"file {path} does not exist")
    pyproject = cwd / "pyproject.toml"
    if pyproject.is_file():
        data = _load_toml(pyproject)
        table = data.get("tool", {}).get(PYPROJECT_TABLE)
        if isinstance(table, dict):
            return table, f"{pyproject} [tool.{PYPROJECT_TABLE}]"
    return {}, ""


def _load_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("(file)", str(path), f"not valid TOML: {exc}") from None


def _from_env(environ: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    found: dict[str, tuple[str, str]] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        suffix = name[len(ENV_PREFIX) :]
        if suffix in NON_CONFIG_ENV:
            continue
        key = suffix.lower()
        if key not in KEYS:
            raise ConfigError(key, name, _UNKNOWN_KEY)
        found[key] = (value, name)
    return found


def load_settings(
    flags: Mapping[str, Any] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> Settings:
    """Merge every source into `Settings`, validating each value where it came from.

    `flags` holds only the options the user actually passed (None means "not given").
    """
    env = os.environ if environ is None else environ
    merged: dict[str, tuple[Any, str]] = {}
    file_values, file_source = _from_files(cwd or Path.cwd())
    for key, value in file_values.items():
        if key not in KEYS:
            raise ConfigError(key, file_source, _UNKNOWN_KEY)
        merged[key] = (value, file_source)
    for key, (value, source) in _from_env(env).items():
        merged[key] = (value, source)
    for key, value in (flags or {}).items():
        if value is None:
            continue
        if key not in KEYS:
            raise ConfigError(key, "command line", "unknown option")
        merged[key] = (value, "--" + key.replace("_", "-"))

    spec_values: dict[str, Any] = {}
    settings_values: dict[str, Any] = {}
    for key, (raw, source) in merged.items():
        parser = _SPEC_KEYS.get(key) or _SETTINGS_KEYS[key]
        try:
            parsed = parser(raw)
        except ValueError as exc:
            raise ConfigError(key, source, str(exc)) from None
        (spec_values if key in _SPEC_KEYS else settings_values)[key] = parsed
    spec = OutboxSpec(**spec_values)
    _check_distinct(spec, {k: s for k, (_, s) in merged.items()})
    return Settings(
        spec=spec,
        sources={k: s for k, (_, s) in merged.items()},
        **settings_values,
    )


def _check_distinct(spec: OutboxSpec, sources: Mapping[str, str]) -> None:
    """The four relations must have four different names, and the columns distinct roles."""

    def refuse(key: str, problem: str) -> ConfigError:
        return ConfigError(key, sources.get(key, "defaults"), problem)

    seen: dict[str, str] = {}
    for key in ("table", "partitioned_table", "unpublished_partition", "published_partition"):
        name = getattr(spec, key)
        if name in seen:
            used = f"{name!r} is already used for {seen[name]}"
            raise refuse(key, f"{used}; each relation needs its own name")
        seen[name] = key
    if spec.id_column == spec.published_column:
        raise refuse("published_column", "must differ from id_column")
    if bool(spec.status_column) != bool(spec.status_published_value):
        key = "status_published_value" if spec.status_column else "status_column"
        together = "status_column and status_published_value go together"
        raise refuse(key, f"{together}: the relay sets the column to the value on publish")
    if spec.status_column in (spec.published_column, spec.id_column):
        raise refuse("status_column", "must differ from published_column and id_column")
    if spec.order_column and spec.id_kind == "database":
        only = "applies to application ids only (id_kind = application)"
        raise refuse("order_column", f"{only}; database ids are claimed by id")
    roles = {"id_column": spec.id_column, "published_column": spec.published_column,
             "payload_column": spec.payload_column}  # fmt: skip
    for key, name in roles.items():
        if name in spec.metadata_columns:
            role = key.removesuffix("_column")
            raise refuse("metadata_columns", f"{name!r} is the {role} column, not metadata")


def with_spec(settings: Settings, **changes: Any) -> Settings:
    """A copy of `settings` with some spec names changed (used by tests and the simulator)."""
    return replace(settings, spec=replace(settings.spec, **changes))
