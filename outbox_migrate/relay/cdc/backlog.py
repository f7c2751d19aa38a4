"""The first start's backlog: the rows the new slot's exported snapshot shows unpublished.

The snapshot defines *which* rows are the backlog (everything later comes through the
stream): no gap, no overlap. It is used for that alone, in one short transaction, then ended
(its xmin holds back VACUUM). The rows are read by id in batches, each its own transaction,
and published with no transaction open (`CdcRelay._publish_backlog`); a row marked meanwhile
is not found again.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator
from typing import Any

from psycopg import sql

from outbox_migrate.config import OutboxSpec
from outbox_migrate.sql import query

ID_FETCH_ROWS = 10_000
"""Ids fetched per round trip while the snapshot is imported."""


class IdRuns:
    """The backlog's ids as ascending runs of consecutive ids (16 bytes a run)."""

    def __init__(self) -> None:
        self.firsts = array("q")
        self.lasts = array("q")

    def add(self, i: int) -> None:
        """Append an id (ascending); a repeated id is one message."""
        lasts = self.lasts
        if lasts and lasts[-1] + 1 == i:
            lasts[-1] = i
        elif not lasts or lasts[-1] != i:
            self.firsts.append(i)
            lasts.append(i)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return zip(self.firsts, self.lasts, strict=True)

    def __len__(self) -> int:
        return len(self.firsts)


def snapshot_ids(conn: Any, snapshot: str, spec: OutboxSpec) -> IdRuns:
    """The ids the exported snapshot shows in the unpublished partition (one transaction,
    no broker in it)."""
    runs = IdRuns()
    select = query("cdc", "backlog-ids").compose(
        id=sql.Identifier(spec.id_column),
        table=sql.Identifier(spec.schema, spec.unpublished_partition),
    )
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot)))
        with conn.cursor(name="outbox_cdc_backlog_ids") as cursor:
            cursor.itersize = ID_FETCH_ROWS
            cursor.execute(select)
            for (value,) in cursor:
                runs.add(int(value))
    return runs


def chunks(runs: Iterable[tuple[int, int]], size: int) -> Iterator[list[int]]:
    """The ids of `runs` in order, `size` at a time."""
    chunk: list[int] = []
    for first, last in runs:
        i = first
        while i <= last:
            take = min(last, i + size - len(chunk) - 1)
            chunk.extend(range(i, take + 1))
            i = take + 1
            if len(chunk) == size:
                yield chunk
                chunk = []
    if chunk:
        yield chunk
