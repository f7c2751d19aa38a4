"""`outbox-migrate dead-letters`: list, show, requeue and purge, over relay/dead_letters.py
(exit codes: docs/cli.md, "Dead letters")."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Annotated, Any

import typer

from outbox_migrate.cli.options import (
    DsnOption,
    FormatOption,
    OutputFormat,
    report,
    require_dsn,
    settings_from,
    with_names,
)
from outbox_migrate.errors import NothingDone

GROUP_HELP = (
    "The relay's dead letters: list, show, requeue (same id or a new one; picked up at once), "
    "purge. Exit 1 when an --id asked for is not there.\n\n"
    "Example: outbox-migrate dead-letters list --format json --dsn $DATABASE_URL"
)

IdsOption = Annotated[
    list[str] | None, typer.Option("--id", help="A dead letter's id (repeatable).")
]
ReasonOption = Annotated[
    str | None, typer.Option("--reason", help="Text any of its reasons contains (e.g. 23505).")
]
SinceOption = Annotated[
    datetime | None, typer.Option("--since", help="Dead-lettered at or after (ISO 8601).")
]
UntilOption = Annotated[
    datetime | None, typer.Option("--until", help="Dead-lettered before (ISO 8601).")
]
SourceOption = Annotated[
    str | None, typer.Option("--source", help="Its source table (schema.table).")
]
TableOption = Annotated[
    str, typer.Option("--dead-letter-table", help="The relay's dead-letter table.")
]
LimitOption = Annotated[int, typer.Option("--limit", min=1, help="At most this many.")]
NewIdOption = Annotated[
    bool,
    typer.Option("--new-id", help="Give each message a new id from the id column's default "
                 "(default: keep its id)."),
]  # fmt: skip
ChannelOption = Annotated[
    str, typer.Option("--channel", help="The relay's wake-up channel (relay --channel).")
]


def register(app: typer.Typer) -> None:
    group = typer.Typer(name="dead-letters", help=GROUP_HELP, no_args_is_help=True,
                        rich_markup_mode=None, add_completion=False)  # fmt: skip
    group.command("list", help="The dead letters, oldest message first.\n\n"
                  "Example: outbox-migrate dead-letters list --since 2026-11-28 --format json "
                  "--dsn $DATABASE_URL")(with_names(_reader(detailed=False)))  # fmt: skip
    group.command("show", help="Every field of the dead letters selected.\n\n"
                  "Example: outbox-migrate dead-letters show --reason 23505 --dsn $DATABASE_URL")(
        with_names(_reader(detailed=True)))  # fmt: skip
    group.command(
        "requeue",
        help="Write the selected dead letters back into the outbox, oldest first (key order), "
        "with their headers, payload, key, type and created_at; the relay is woken at once "
        "(NOTIFY on its channel). The dead letter goes in the same transaction.\n\n"
        "Example: outbox-migrate dead-letters requeue --reason 23505 --new-id --dsn $DATABASE_URL",
    )(with_names(requeue_command))
    group.command("purge", help="Delete the selected dead letters for good.\n\n"
                  "Example: outbox-migrate dead-letters purge --until 2026-11-01 "
                  "--dsn $DATABASE_URL")(with_names(purge_command))  # fmt: skip
    app.add_typer(group, name="dead-letters")


def _selection(ids: list[str] | None, reason: str | None, since: datetime | None,
               until: datetime | None, source: str | None) -> Any:  # fmt: skip
    from outbox_migrate.relay.dead_letters import Selection

    return Selection(tuple(ids or ()), reason, since, until, source)


@contextmanager
def _opened(dsn: str | None, table: str, names: dict[str, Any]) -> Iterator[tuple[Any, Any]]:
    """A connection and the spec, once the dead-letter table is known to exist."""
    from psycopg import sql

    from outbox_migrate.db import connect
    from outbox_migrate.errors import UsageError

    spec = settings_from(**names).spec
    with connect(require_dsn(dsn)) as conn:
        name = sql.Identifier(spec.schema, table).as_string(conn)
        if conn.execute("SELECT to_regclass(%s)", (name,)).fetchone() == (None,):
            raise UsageError(f"{name} does not exist (created by the migration's "
                             "create-dead-letter-tables step, or by the relay)")  # fmt: skip
        yield conn, spec


def _reader(*, detailed: bool) -> Callable[..., None]:
    """`list` (a line each) or `show` (every field; exit 1 for an --id not there)."""

    def read(
        dsn: DsnOption = None, ids: IdsOption = None, reason: ReasonOption = None,
        since: SinceOption = None, until: UntilOption = None, source: SourceOption = None,
        dead_letter_table: TableOption = "outbox_dead_letter", limit: LimitOption = 100,
        output: FormatOption = OutputFormat.text, *, names: dict[str, Any],
    ) -> None:  # fmt: skip
        from outbox_migrate.relay.dead_letters import listed

        selection = _selection(ids, reason, since, until, source)
        with _opened(dsn, dead_letter_table, names) as (conn, spec):
            letters = listed(conn, spec.schema, dead_letter_table, selection, limit)
        if detailed:  # every field, a blank line after each letter
            lines = [line for d in letters for line in (*(f"{k}: {v}" for k, v in d.items()), "")]
        else:
            lines = [
                f"{d['source_table']} id={d['id']} key={d['message_key']} type={d['event_type']} "
                f"attempts={d['attempts']} delivered={d['delivered']} dead_at={d['dead_at']} "
                f"{d['last_error']}"
                for d in letters
            ] + [f"{len(letters)} dead letter(s)"]
        report(output, letters, *lines)
        if detailed:
            _missing(ids, [d["id"] for d in letters])

    return read


def requeue_command(
    dsn: DsnOption = None, ids: IdsOption = None, reason: ReasonOption = None,
    since: SinceOption = None, until: UntilOption = None, source: SourceOption = None,
    dead_letter_table: TableOption = "outbox_dead_letter", new_id: NewIdOption = False,
    channel: ChannelOption = "outbox_migrate_relay", output: FormatOption = OutputFormat.text, *,
    names: dict[str, Any],
) -> None:  # fmt: skip
    from outbox_migrate.relay.dead_letters import requeue
    from outbox_migrate.relay.options import ATTEMPTS_TABLE_SUFFIX

    selection = _selection(ids, reason, since, until, source)
    with _opened(dsn, dead_letter_table, names) as (conn, spec):
        done = requeue(conn, spec, dead_letter_table, dead_letter_table + ATTEMPTS_TABLE_SUFFIX,
                       selection, new_id=new_id, channel=channel)  # fmt: skip
    _report("requeued", [{"source_table": r.source_table, "id": r.old_id, "new_id": r.new_id}
                         for r in done], output)  # fmt: skip
    _missing(ids, [r.old_id for r in done])


def purge_command(
    dsn: DsnOption = None, ids: IdsOption = None, reason: ReasonOption = None,
    since: SinceOption = None, until: UntilOption = None, source: SourceOption = None,
    dead_letter_table: TableOption = "outbox_dead_letter",
    output: FormatOption = OutputFormat.text, *, names: dict[str, Any],
) -> None:  # fmt: skip
    from outbox_migrate.relay.dead_letters import purge

    selection = _selection(ids, reason, since, until, source)
    with _opened(dsn, dead_letter_table, names) as (conn, spec):
        gone = purge(conn, spec.schema, dead_letter_table, selection)
    _report("purged", [{"id": i} for i in gone], output)
    _missing(ids, gone)


def _report(what: str, done: list[dict[str, Any]], output: OutputFormat) -> None:
    lines = [f"{what} " + " ".join(f"{k}={v}" for k, v in item.items()) for item in done]
    report(output, {what: done}, *lines, f"{len(done)} dead letter(s) {what}")


def _missing(asked: list[str] | None, found: list[str]) -> None:
    """Ids asked for by --id and not there: exit 1, naming them (after doing the rest)."""
    missing = [i for i in asked or () if i not in set(found)]
    if missing:
        raise NothingDone(f"no dead letter with id {', '.join(missing)}")
