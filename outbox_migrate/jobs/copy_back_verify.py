"""Copy-back's verification: every source row compared with the target, one short statement
per range. Reads only; the job stamps `verified_at` when this passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from outbox_migrate.errors import OutboxMigrateError
from outbox_migrate.jobs import common
from outbox_migrate.jobs.common import Relation
from outbox_migrate.jobs.copy_back_ids import CopyIds, IdValue


@dataclass(frozen=True)
class RangeCheck:
    low: IdValue
    high: IdValue | None
    """Exclusive upper bound (None: the last range of application ids, unbounded)."""
    source_rows: int
    target_rows: int
    source_md5: str
    target_md5: str

    @property
    def ok(self) -> bool:
        return self.source_rows == self.target_rows and self.source_md5 == self.target_md5

    def describe(self) -> str:
        what = (
            f"{self.target_rows} of {self.source_rows} rows present"
            if self.source_rows != self.target_rows
            else "rows differ"
        )
        high = "" if self.high is None else self.high
        return f"ids [{self.low}, {high}) ({what})"


@dataclass(frozen=True)
class Verification:
    source: str
    target: str
    source_rows: int
    matched_rows: int
    ranges_checked: int
    differing: tuple[RangeCheck, ...]
    source_max_id: IdValue | None

    @property
    def passed(self) -> bool:
        return not self.differing and self.source_rows == self.matched_rows

    def check(self) -> None:
        if not self.passed:
            raise VerificationFailed(self.source, self.target, list(self.differing))


class VerificationFailed(OutboxMigrateError):
    """The target does not hold every source row identically; the drop is refused."""

    def __init__(self, source: str, target: str, ranges: list[RangeCheck]) -> None:
        self.ranges = ranges
        shown = ", ".join(r.describe() for r in ranges[:5])
        more = f" and {len(ranges) - 5} more" if len(ranges) > 5 else ""
        super().__init__(
            f"verification of {target} against {source} failed in {len(ranges)} id "
            f"range(s): {shown}{more}; {source} was not dropped"
        )


def range_statement(
    ids: CopyIds, source: Relation, target: Relation, cols: tuple[str, ...], *, bounded: bool
) -> sql.Composed:
    """Counts and checksums of one id range, `[low, high)` or `[low, …)`.

    Rows the target gained on its own (published after V4 through the partitioned table)
    share the id space, so the target side is restricted to source ids by the join; a missing
    target row shows up in the count, a changed one in the checksum. The range repeated on
    the target side is implied by the join, but spelling it out keeps each query to one range
    of both tables: without it the planner may hash the whole target for every range once the
    tables are large."""
    low, high, key = ids.bound("low"), ids.bound("high"), ids.column
    upper_t = sql.SQL(" AND t.{id} < {high}" if bounded else "").format(id=key, high=high)
    upper_s = sql.SQL(" AND s.{id} < {high}" if bounded else "").format(id=key, high=high)
    return sql.SQL(
        "SELECT count(*), count(t.{id}),"
        " coalesce(md5(string_agg(ROW({s_cols})::text, E'\\n' ORDER BY s.{id})), ''),"
        " coalesce(md5(string_agg(ROW({t_cols})::text, E'\\n' ORDER BY s.{id})"
        "   FILTER (WHERE t.{id} IS NOT NULL)), '')"
        " FROM {source} s LEFT JOIN {target} t ON t.{id} = s.{id}"
        "   AND t.{id} >= {low}{upper_t}"
        " WHERE s.{id} >= {low}{upper_s}"
    ).format(
        low=low,
        upper_t=upper_t,
        upper_s=upper_s,
        id=key,
        s_cols=common.column_list(cols, "s"),
        t_cols=common.column_list(cols, "t"),
        source=source.ident,
        target=target.ident,
    )


def verify_ranges(
    conn: psycopg.Connection[Any],
    ids: CopyIds,
    source: Relation,
    target: Relation,
    cols: tuple[str, ...],
    width: int,
) -> Verification:
    """Walk the source in ranges (`CopyIds.range_end`: `width` ids, or `width` rows for
    application ids, the last one unbounded) and compare each with the target."""
    bounded = range_statement(ids, source, target, cols, bounded=True)
    unbounded = range_statement(ids, source, target, cols, bounded=False)
    _, low, highest = ids.ends(conn)
    source_rows = matched = checked = 0
    differing: list[RangeCheck] = []
    while low is not None:
        high = ids.range_end(low, width)
        statement = unbounded if high is None else bounded
        row = conn.execute(statement, {"low": low, "high": high}).fetchone()
        assert row is not None
        low_value = ids.value(low)
        assert low_value is not None
        check = RangeCheck(low_value, ids.value(high), int(row[0]), int(row[1]), row[2], row[3])
        checked += 1
        source_rows += check.source_rows
        matched += check.target_rows
        if not check.ok:
            differing.append(check)
        low = None if high is None else ids.first_at_or_above(high)
    return Verification(
        source=str(source),
        target=str(target),
        source_rows=source_rows,
        matched_rows=matched,
        ranges_checked=checked,
        differing=tuple(differing),
        source_max_id=ids.value(highest),
    )
