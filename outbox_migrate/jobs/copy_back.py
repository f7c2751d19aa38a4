"""HOPER's copy-back: move every row of the detached published partition into the old table.

After HOPER's V4 swap the old flat table is the DEFAULT partition of the partitioned outbox
and the former DEFAULT partition (the *source*) is a detached, standalone table holding the
rows published between V2 and V4. This job copies those rows into the old table (the
*target*) in keyset batches by id, verifies the copy range by range, and only then drops the
source. It must never drop a source whose rows are not all, identically, in the target.

Safety properties, and how they are kept:
- Idempotent: `ON CONFLICT (id) DO NOTHING` on the target's primary key, so a batch copied
  twice (a crash between commit and acknowledgement) is harmless.
- Resumable: each batch and its high-water mark commit in one statement (one transaction), so
  the persisted mark never runs ahead of, nor behind, the data.
- Gentle: every batch is its own short transaction (no long snapshot holds back vacuum of
  the busy unpublished partition); a `Throttle` caps the rate and backs off on measured
  foreground impact.
- Verified: per-id-range row counts and md5 checksums, source vs target; a mismatch names
  the ranges and the drop is refused.

Table and column names come from `OutboxSpec`; this module never prints and never exits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from outbox_migrate.config import OutboxSpec
from outbox_migrate.errors import ExitCode, OutboxMigrateError, SchemaError, UsageError
from outbox_migrate.jobs import common
from outbox_migrate.jobs.common import Relation
from outbox_migrate.jobs.throttle import Impact, LatencyProbe, Throttle, ThrottlePolicy
from outbox_migrate.lock_budget import LockBudget, run_with_lock_budget
from outbox_migrate.patterns.model import LockMode

DEFAULT_BATCH_ROWS = 10_000
"""Rows per batch: large enough to amortise the round trip, small enough for short locks."""
DEFAULT_VERIFY_RANGE_IDS = 100_000
"""Width, in ids, of one verification range (one short query each)."""
DROP_LOCK_TIMEOUT_MS = 2_000
"""lock_timeout for the DROP of the source: never queue long behind a reader of it."""
INDEX_LOCK_TIMEOUT_MS = 2_000
"""lock_timeout for building the keyset index on the source."""
LOCK_BUDGET_S = 30.0
"""How long the DROP and the index build may keep retrying their short lock attempts (the
tool's one lock-budget primitive: a known holder is watched, not queued behind)."""
RATE_WINDOW_S = 5.0
"""Window over which the reported rows/s (and so the ETA) is measured."""

PROGRESS_TABLE = "copy_back_progress"

IdValue = int | str
"""An id as copy-back handles it: an integer, or an application id (uuid, ULID) as text."""


class CopyBackError(OutboxMigrateError):
    """The copy-back cannot proceed in the current state (names what is wrong)."""


class CopyBackBusy(OutboxMigrateError):
    """Another process is already copying this source into this target."""

    exit_code = ExitCode.BUSY


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


@dataclass(frozen=True)
class CopyBackOptions:
    batch_rows: int = DEFAULT_BATCH_ROWS
    verify_range_ids: int = DEFAULT_VERIFY_RANGE_IDS
    throttle: ThrottlePolicy = field(default_factory=ThrottlePolicy)


@dataclass(frozen=True)
class CopyPlan:
    """What `run` would do, read without changing anything."""

    source: str
    target: str
    columns: tuple[str, ...]
    source_rows: int
    source_min_id: IdValue | None
    source_max_id: IdValue | None
    high_water: IdValue | None
    remaining_rows: int
    needs_index: bool
    state: str
    """`copy` (rows left), `verify` (copied, not dropped), `done` (source dropped)."""


@dataclass(frozen=True)
class CopyProgress:
    """Reported after every batch (the CLI turns it into a progress bar)."""

    copied_rows: int
    """Rows handled so far in this copy (inserted or already present), restarts included."""
    total_rows: int
    high_water: IdValue | None
    rows_per_s: float
    eta_s: float | None
    pause_s: float
    impact: Impact | None

    @property
    def copied(self) -> int:
        """Alias of `copied_rows` (the runner's progress events read `copied`/`total`)."""
        return self.copied_rows

    @property
    def total(self) -> int:
        return self.total_rows


@dataclass(frozen=True)
class CopyResult:
    inserted_rows: int
    """Rows this run inserted into the target."""
    present_rows: int
    """Rows this run found already in the target (a previous, interrupted run)."""
    batches: int
    elapsed_s: float
    paused_s: float
    high_water: IdValue | None
    resumed_from: IdValue | None
    stopped: bool
    """True when `stop` was set before the copy finished."""

    @property
    def rows_per_s(self) -> float:
        total = self.inserted_rows + self.present_rows
        return total / self.elapsed_s if self.elapsed_s > 0 else 0.0


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


ProgressCallback = Callable[[CopyProgress], None]


class RateMeter:
    """Rows/s over a sliding window, so the ETA follows the current (throttled) pace."""

    def __init__(self, started: float) -> None:
        self._window: list[tuple[float, int]] = [(started, 0)]

    def add(self, done: int) -> float:
        now = time.monotonic()
        self._window.append((now, done))
        while len(self._window) > 2 and now - self._window[1][0] > RATE_WINDOW_S:
            self._window.pop(0)
        first_t, first_done = self._window[0]
        span = now - first_t
        return (done - first_done) / span if span > 0 else 0.0


class CopyBack:
    """Plan, run, verify and drop for one (source, target) pair named by an `OutboxSpec`.

    `conn` must be an autocommit connection (see `outbox_migrate.db.connect`): each batch is
    a single statement and therefore its own transaction. `dsn` is used only to open the
    latency-probe connection.
    """

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        spec: OutboxSpec,
        options: CopyBackOptions | None = None,
        *,
        dsn: str | None = None,
    ) -> None:
        if not conn.autocommit:
            raise UsageError("copy-back needs an autocommit connection")
        self.conn = conn
        self.spec = spec
        self.options = options or CopyBackOptions()
        self.dsn = dsn
        self.source = Relation(spec.schema, spec.published_partition)
        self.target = Relation(spec.schema, spec.table)
        self.progress_rel = Relation(common.STATE_SCHEMA, PROGRESS_TABLE)
        self.index_name = common.fit_identifier(spec.published_partition, "_copy_back_id_idx")
        self._id = sql.Identifier(spec.id_column)
        self._text_ids = spec.id_kind == "application"
        """Application ids (uuid, ULID): keyset batches and verification ranges by the id's
        own order, carried as text (uuid has no min()/max(), and no arithmetic for ranges)."""
        self._id_type_sql: sql.Composable | None = None

    # -- state -----------------------------------------------------------------------------

    def _key(self) -> tuple[str, str, str, str]:
        return (self.source.schema, self.source.name, self.target.schema, self.target.name)

    def ensure_state_table(self) -> None:
        """The progress table (ours; the runner owns the schema's other tables)."""
        common.ensure_state_schema(self.conn)
        self.conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {t} ("
                " source_schema text NOT NULL, source_table text NOT NULL,"
                " target_schema text NOT NULL, target_table text NOT NULL,"
                " high_water bigint,"
                " rows_inserted bigint NOT NULL DEFAULT 0,"
                " rows_present bigint NOT NULL DEFAULT 0,"
                " batches bigint NOT NULL DEFAULT 0,"
                " total_rows bigint,"
                " started_at timestamptz NOT NULL DEFAULT now(),"
                " updated_at timestamptz NOT NULL DEFAULT now(),"
                " copied_at timestamptz, verified_at timestamptz, dropped_at timestamptz,"
                " PRIMARY KEY (source_schema, source_table, target_schema, target_table))"
            ).format(t=self.progress_rel.ident)
        )
        self._ensure_text_high_water()

    def _ensure_text_high_water(self) -> None:
        """Application ids keep their high-water mark as text, in a column of its own (added
        to a progress table an integer copy-back created before)."""
        if self._text_ids:
            self.conn.execute(
                sql.SQL("ALTER TABLE {t} ADD COLUMN IF NOT EXISTS high_water_id text").format(
                    t=self.progress_rel.ident
                )
            )

    @property
    def _high_water_column(self) -> sql.Identifier:
        return sql.Identifier("high_water_id" if self._text_ids else "high_water")

    def _id_type(self) -> sql.Composable:
        """The id's SQL type (from the catalog), to cast text bounds back to it."""
        if self._id_type_sql is None:
            row = self.conn.execute(
                "SELECT format_type(a.atttypid, a.atttypmod) FROM pg_attribute a "
                "WHERE a.attrelid = to_regclass(%s) AND a.attname = %s",
                (self.source.ident.as_string(self.conn), self.spec.id_column),
            ).fetchone()
            self._id_type_sql = sql.SQL(str(row[0]) if row and row[0] else "text")
        return self._id_type_sql

    def _bound(self, name: str) -> sql.Composed:
        """A bound parameter compared with the id: as is for integers, cast for text ids."""
        if not self._text_ids:
            return sql.SQL("{}").format(sql.Placeholder(name))
        return sql.SQL("{}::{}").format(sql.Placeholder(name), self._id_type())

    def _id_out(self, alias: str = "") -> sql.Composed:
        """The id as selected: as is, or as text for application ids."""
        ident = sql.Identifier(alias, self.spec.id_column) if alias else self._id
        return sql.SQL("{}::text" if self._text_ids else "{}").format(ident)

    def _ends(self) -> sql.Composed:
        """`count(*), lowest id, highest id` of the source (ORDER BY … LIMIT 1 for text ids:
        uuid has no min()/max())."""
        if not self._text_ids:
            return sql.SQL("count(*), min({id}), max({id})").format(id=self._id)
        return sql.SQL(
            "count(*), (SELECT {out} FROM {s} ORDER BY {id} LIMIT 1), "
            "(SELECT {out} FROM {s} ORDER BY {id} DESC LIMIT 1)"
        ).format(out=self._id_out(), s=self.source.ident, id=self._id)

    def _state_row(self) -> dict[str, Any] | None:
        if not common.exists(self.conn, self.progress_rel):
            return None
        self._ensure_text_high_water()
        cur = self.conn.execute(
            sql.SQL(
                "SELECT {hw} AS high_water, rows_inserted, rows_present, batches, total_rows,"
                " copied_at, verified_at, dropped_at FROM {t} WHERE source_schema = %s"
                " AND source_table = %s AND target_schema = %s AND target_table = %s"
            ).format(t=self.progress_rel.ident, hw=self._high_water_column),
            self._key(),
        )
        row = cur.fetchone()
        if row is None:
            return None
        names = [d.name for d in cur.description or []]
        return dict(zip(names, row, strict=True))

    # -- plan ------------------------------------------------------------------------------

    def _check_shape(self) -> tuple[str, ...]:
        """Preconditions on the live schema; returns the columns to copy."""
        if not common.exists(self.conn, self.target):
            raise SchemaError(f"copy-back target {self.target} does not exist")
        if common.is_partition(self.conn, self.source):
            raise CopyBackError(
                f"{self.source} is still a partition: copy-back runs after HOPER's V4 swap "
                "has detached it (rows could still arrive and be missed)"
            )
        if not common.has_unique_index_on(self.conn, self.target, self.spec.id_column):
            raise SchemaError(
                f"{self.target} has no unique index on ({self.spec.id_column}); "
                "copy-back relies on it to skip rows already copied"
            )
        source_cols = common.columns(self.conn, self.source)
        target_cols = common.columns(self.conn, self.target)
        missing = [c for c in source_cols if c not in target_cols]
        if missing:
            raise SchemaError(
                f"{self.target} lacks column(s) {', '.join(missing)} of {self.source}; "
                "copying would lose data"
            )
        if self.spec.id_column not in source_cols:
            raise SchemaError(f"{self.source} has no column {self.spec.id_column}")
        # Target column order, restricted to the source's columns: both sides of every
        # statement use this one list, so differing physical column orders do not matter.
        return tuple(c for c in target_cols if c in source_cols)

    def plan(self) -> CopyPlan:
        state = self._state_row()
        if not common.exists(self.conn, self.source):
            if state is not None and state["dropped_at"] is not None:
                return CopyPlan(str(self.source), str(self.target), (), 0, None, None,
                                state["high_water"], 0, False, "done")  # fmt: skip
            raise SchemaError(
                f"copy-back source {self.source} does not exist and no finished copy-back "
                "of it is recorded"
            )
        cols = self._check_shape()
        row = self.conn.execute(
            sql.SQL("SELECT {ends} FROM {s}").format(ends=self._ends(), s=self.source.ident)
        ).fetchone()
        assert row is not None
        total, lo, hi = int(row[0]), row[1], row[2]
        high_water = state["high_water"] if state and state["dropped_at"] is None else None
        if high_water is None:
            remaining = total
        else:
            rem = self.conn.execute(
                sql.SQL("SELECT count(*) FROM {s} WHERE {id} > {after}").format(
                    id=self._id, s=self.source.ident, after=self._bound("after")
                ),
                {"after": high_water},
            ).fetchone()
            remaining = int(rem[0]) if rem else 0
        copied = state is not None and state["dropped_at"] is None and state["copied_at"]
        return CopyPlan(
            source=str(self.source),
            target=str(self.target),
            columns=cols,
            source_rows=total,
            source_min_id=lo,
            source_max_id=hi,
            high_water=high_water,
            remaining_rows=remaining,
            needs_index=not common.has_btree_leading(self.conn, self.source, self.spec.id_column),
            state="verify" if copied and remaining == 0 else "copy",
        )

    # -- run -------------------------------------------------------------------------------

    def ensure_source_index(self) -> None:
        """A btree on the source's id, so each keyset batch is an index range scan.

        The published partition has no index by design, and without one every batch would
        scan and sort the whole source. A plain (not CONCURRENTLY) build is right here: the
        source is detached, no application writes to it, and the SHARE lock it takes only
        blocks writes; lock_timeout keeps us from queueing behind an unexpected reader.
        """
        if common.has_btree_leading(self.conn, self.source, self.spec.id_column):
            return
        statement = sql.SQL("CREATE INDEX IF NOT EXISTS {i} ON {s} ({id})").format(
            i=sql.Identifier(self.index_name), s=self.source.ident, id=self._id
        )
        run_with_lock_budget(
            self.conn, "copy-back.source-index",
            LockBudget(lock_timeout_ms=INDEX_LOCK_TIMEOUT_MS, budget_s=LOCK_BUDGET_S),
            lambda conn: conn.execute(statement), relations=((self.source.name, LockMode.SHARE),),
            schema=self.source.schema,
        )  # fmt: skip

    def _start_state(self, total_rows: int) -> dict[str, Any]:
        state = self._state_row()
        if state is not None and state["dropped_at"] is not None:
            # A source with these names was copied and dropped before; this one is new.
            self.conn.execute(
                sql.SQL(
                    "DELETE FROM {t} WHERE source_schema = %s AND source_table = %s"
                    " AND target_schema = %s AND target_table = %s"
                ).format(t=self.progress_rel.ident),
                self._key(),
            )
            state = None
        if state is None:
            self.conn.execute(
                sql.SQL(
                    "INSERT INTO {t} (source_schema, source_table, target_schema, target_table,"
                    " total_rows) VALUES (%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING"
                ).format(t=self.progress_rel.ident),
                (*self._key(), total_rows),
            )
            state = self._state_row()
        assert state is not None
        return state

    def _batch_statement(self, cols: tuple[str, ...], *, first: bool = False) -> sql.Composed:
        # One statement = one transaction: the rows and the high-water mark that covers them
        # commit together, so a kill at any point leaves a mark that is exact.
        if self._text_ids:
            return self._text_batch_statement(cols, first=first)
        return sql.SQL(
            "WITH batch AS MATERIALIZED ("
            " SELECT {cols} FROM {source} WHERE {id} > %(after)s ORDER BY {id} LIMIT %(limit)s"
            "), copied AS ("
            " INSERT INTO {target} ({cols}) OVERRIDING SYSTEM VALUE"
            " SELECT {cols} FROM batch ORDER BY {id} ON CONFLICT ({id}) DO NOTHING RETURNING 1"
            "), summary AS ("
            " SELECT count(*) AS n, max({id}) AS hw, (SELECT count(*) FROM copied) AS ins"
            " FROM batch"
            "), mark AS ("
            " UPDATE {progress} p SET high_water = s.hw, rows_inserted = p.rows_inserted + s.ins,"
            " rows_present = p.rows_present + s.n - s.ins, batches = p.batches + 1,"
            " updated_at = now() FROM summary s WHERE s.n > 0 AND p.source_schema = %(ss)s"
            " AND p.source_table = %(st)s AND p.target_schema = %(ts)s AND p.target_table = %(tt)s"
            ") SELECT n, hw, ins FROM summary"
        ).format(
            cols=common.column_list(cols),
            source=self.source.ident,
            target=self.target.ident,
            id=self._id,
            progress=self.progress_rel.ident,
        )

    def _text_batch_statement(self, cols: tuple[str, ...], *, first: bool) -> sql.Composed:
        """`_batch_statement` for application ids: the first batch has no lower bound (there is
        no id below every uuid to start after, and `$1 IS NULL OR id > $1` would defeat the
        index), the mark is the batch's last id as text."""
        after = (
            sql.SQL("")
            if first
            else sql.SQL(" WHERE {id} > {after}").format(id=self._id, after=self._bound("after"))
        )
        return sql.SQL(
            "WITH batch AS MATERIALIZED ("
            " SELECT {cols} FROM {source}{after} ORDER BY {id} LIMIT %(limit)s"
            "), copied AS ("
            " INSERT INTO {target} ({cols}) OVERRIDING SYSTEM VALUE"
            " SELECT {cols} FROM batch ORDER BY {id} ON CONFLICT ({id}) DO NOTHING RETURNING 1"
            "), summary AS ("
            " SELECT (SELECT count(*) FROM batch) AS n,"
            " (SELECT {out} FROM batch ORDER BY {id} DESC LIMIT 1) AS hw,"
            " (SELECT count(*) FROM copied) AS ins"
            "), mark AS ("
            " UPDATE {progress} p SET high_water_id = s.hw,"
            " rows_inserted = p.rows_inserted + s.ins,"
            " rows_present = p.rows_present + s.n - s.ins, batches = p.batches + 1,"
            " updated_at = now() FROM summary s WHERE s.n > 0 AND p.source_schema = %(ss)s"
            " AND p.source_table = %(st)s AND p.target_schema = %(ts)s AND p.target_table = %(tt)s"
            ") SELECT n, hw, ins FROM summary"
        ).format(
            cols=common.column_list(cols),
            source=self.source.ident,
            after=after,
            target=self.target.ident,
            id=self._id,
            out=self._id_out(),
            progress=self.progress_rel.ident,
        )

    def _start_probe(self) -> LatencyProbe | None:
        if not self.options.throttle.adaptive or self.dsn is None:
            return None
        probe = LatencyProbe(
            self.dsn,
            sql.Identifier(self.spec.schema, self.spec.unpublished_partition),
            self._id,
        )
        try:
            probe.start()
        except (OutboxMigrateError, psycopg.Error):
            probe.stop()
            return None  # nothing to probe (no unpublished partition): the rate still holds
        return probe

    def _mark(self, column: str) -> None:
        """Stamp `copied_at`, `verified_at` or `dropped_at` on the progress row."""
        if not common.exists(self.conn, self.progress_rel):
            return
        self.conn.execute(
            sql.SQL(
                "UPDATE {t} SET {c} = now(), updated_at = now()"
                " WHERE source_schema = %s AND source_table = %s AND target_schema = %s"
                " AND target_table = %s"
            ).format(t=self.progress_rel.ident, c=sql.Identifier(column)),
            self._key(),
        )

    def run(
        self,
        progress: ProgressCallback | None = None,
        stop: threading.Event | None = None,
        *,
        from_start: bool = False,
        plan: CopyPlan | None = None,
    ) -> CopyResult:
        """Copy the rows above the persisted high-water mark; returns when done or stopped.

        `from_start` ignores the mark and walks the whole source again: rows already in the
        target are skipped, missing ones (deleted after they were copied) are copied again.

        One copier per (source, target): a session advisory lock makes a second one raise
        `CopyBackBusy` instead of copying the same batches in parallel.
        """
        # A plan the caller just made saves counting the source twice (a full scan).
        plan = plan or self.plan()
        if plan.state == "done":
            return CopyResult(0, 0, 0, 0.0, 0.0, plan.high_water, plan.high_water, False)
        locked = self.conn.execute(
            "SELECT pg_try_advisory_lock(hashtext(%s))", (self.lock_key,)
        ).fetchone()
        if not (locked and locked[0]):
            raise CopyBackBusy(f"another copy-back of {self.source} into {self.target} is running")
        try:
            return self._run(plan, progress, stop, from_start)
        finally:
            self.conn.execute("SELECT pg_advisory_unlock(hashtext(%s))", (self.lock_key,))

    @property
    def lock_key(self) -> str:
        """Text of the advisory lock (`hashtext`) that admits one copier per pair."""
        return f"outbox-migrate:copy-back:{self.source}:{self.target}"

    def _run(
        self,
        plan: CopyPlan,
        progress: ProgressCallback | None,
        stop: threading.Event | None,
        from_start: bool,
    ) -> CopyResult:
        self.ensure_state_table()
        self.ensure_source_index()
        state = self._start_state(plan.source_rows)
        high_water: IdValue | None = None if from_start else state["high_water"]
        resumed_from = high_water
        already = 0 if from_start else int(state["rows_inserted"]) + int(state["rows_present"])
        remaining = plan.source_rows if from_start else plan.remaining_rows
        total = max(plan.source_rows, already + remaining)
        statement = self._batch_statement(plan.columns)
        first_batch = self._batch_statement(plan.columns, first=True)
        key = dict(zip(("ss", "st", "ts", "tt"), self._key(), strict=True))

        probe = self._start_probe()
        throttle = Throttle(self.conn, self.options.throttle, probe)
        started = time.monotonic()
        meter = RateMeter(started)
        inserted = present = batches = 0
        stopped = False
        # Start below every id: ids are int8 and the source may hold negative ones. Text ids
        # have no such value: their first batch is a statement without the lower bound.
        after: IdValue | None = high_water
        if after is None and not self._text_ids:
            after = -(2**63)
        try:
            while True:
                if stop is not None and stop.is_set():
                    stopped = True
                    break
                row = self.conn.execute(
                    first_batch if after is None else statement,
                    {"after": after, "limit": self.options.batch_rows, **key},
                ).fetchone()
                assert row is not None
                count, batch_high, batch_inserted = int(row[0]), row[1], int(row[2])
                if count == 0:
                    break
                batches += 1
                inserted += batch_inserted
                present += count - batch_inserted
                after = high_water = str(batch_high) if self._text_ids else int(batch_high)
                done = inserted + present
                pause = throttle.wait(done, stop)
                if progress is not None:
                    rate = meter.add(done)
                    left = max(0, total - already - done)
                    progress(
                        CopyProgress(
                            copied_rows=already + done,
                            total_rows=total,
                            high_water=high_water,
                            rows_per_s=rate,
                            eta_s=left / rate if rate > 0 else None,
                            pause_s=pause,
                            impact=throttle.last_impact,
                        )
                    )
        finally:
            if probe is not None:
                probe.stop()
        if not stopped:
            self._mark("copied_at")
        return CopyResult(
            inserted_rows=inserted,
            present_rows=present,
            batches=batches,
            elapsed_s=time.monotonic() - started,
            paused_s=throttle.paused_s,
            high_water=high_water,
            resumed_from=resumed_from,
            stopped=stopped,
        )

    # -- verify ----------------------------------------------------------------------------

    def _range_statement(self, cols: tuple[str, ...], *, bounded: bool = True) -> sql.Composed:
        # Rows the target gained on its own (published after V4 through the partitioned
        # table) share the id space, so the target side is restricted to source ids by the
        # join; a missing target row shows up in the count, a changed one in the checksum.
        # The range repeated on the target side is implied by the join, but spelling it out
        # keeps each query to one range of both tables: without it the planner may hash the
        # whole target for every range once the tables are large.
        low, high = self._bound("low"), self._bound("high")
        upper_t = sql.SQL(" AND t.{id} < {high}" if bounded else "").format(id=self._id, high=high)
        upper_s = sql.SQL(" AND s.{id} < {high}" if bounded else "").format(id=self._id, high=high)
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
            id=self._id,
            s_cols=common.column_list(cols, "s"),
            t_cols=common.column_list(cols, "t"),
            source=self.source.ident,
            target=self.target.ident,
        )

    def verify(self) -> Verification:
        """Compare every source row with the target, one bounded id range per query.

        Each range is its own short statement, so verification of a large source never holds
        a snapshot for long (which would stop vacuum from cleaning the unpublished partition).
        """
        if not common.exists(self.conn, self.source):
            raise CopyBackError(f"{self.source} does not exist: nothing to verify")
        cols = self._check_shape()
        if self._text_ids:
            return self._verify_by_rows(cols)
        statement = self._range_statement(cols)
        next_low = sql.SQL("SELECT min({id}) FROM {s} WHERE {id} >= %s").format(
            id=self._id, s=self.source.ident
        )
        width = self.options.verify_range_ids
        first = self.conn.execute(
            sql.SQL("SELECT min({id}), max({id}) FROM {s}").format(id=self._id, s=self.source.ident)
        ).fetchone()
        assert first is not None
        low, max_id = first[0], first[1]
        source_rows = matched = checked = 0
        differing: list[RangeCheck] = []
        while low is not None:
            high = int(low) + width
            row = self.conn.execute(statement, {"low": low, "high": high}).fetchone()
            assert row is not None
            check = RangeCheck(int(low), high, int(row[0]), int(row[1]), row[2], row[3])
            checked += 1
            source_rows += check.source_rows
            matched += check.target_rows
            if not check.ok:
                differing.append(check)
            nxt = self.conn.execute(next_low, (high,)).fetchone()
            low = nxt[0] if nxt else None
        result = Verification(
            source=str(self.source),
            target=str(self.target),
            source_rows=source_rows,
            matched_rows=matched,
            ranges_checked=checked,
            differing=tuple(differing),
            source_max_id=max_id,
        )
        if result.passed:
            self._mark("verified_at")
        return result

    def _verify_by_rows(self, cols: tuple[str, ...]) -> Verification:
        """`verify` for application ids: ranges of `verify_range_ids` rows in id order (a uuid
        has no arithmetic to make ranges of ids), the last one unbounded above."""
        bounded = self._range_statement(cols)
        last = self._range_statement(cols, bounded=False)
        next_high = sql.SQL(
            "SELECT {out} FROM {s} WHERE {id} >= {low} ORDER BY {id} OFFSET %(width)s LIMIT 1"
        ).format(out=self._id_out(), s=self.source.ident, id=self._id, low=self._bound("low"))
        ends = self.conn.execute(
            sql.SQL("SELECT {ends} FROM {s}").format(ends=self._ends(), s=self.source.ident)
        ).fetchone()
        assert ends is not None
        low: IdValue | None = ends[1]
        source_rows = matched = checked = 0
        differing: list[RangeCheck] = []
        while low is not None:
            found = self.conn.execute(
                next_high, {"low": low, "width": self.options.verify_range_ids}
            ).fetchone()
            high: IdValue | None = found[0] if found else None
            statement = bounded if high is not None else last
            row = self.conn.execute(statement, {"low": low, "high": high}).fetchone()
            assert row is not None
            check = RangeCheck(low, high, int(row[0]), int(row[1]), row[2], row[3])
            checked += 1
            source_rows += check.source_rows
            matched += check.target_rows
            if not check.ok:
                differing.append(check)
            low = high
        result = Verification(
            source=str(self.source),
            target=str(self.target),
            source_rows=source_rows,
            matched_rows=matched,
            ranges_checked=checked,
            differing=tuple(differing),
            source_max_id=ends[2],
        )
        if result.passed:
            self._mark("verified_at")
        return result

    # -- drop ------------------------------------------------------------------------------

    def drop(self, verification: Verification) -> None:
        """Drop the source, only after a verification that passed and still holds.

        The source is locked first (bounded by lock_timeout) and its row count and max id
        compared with what was verified, so rows written to it after verification cannot be
        dropped unseen.
        """
        if not verification.passed:
            raise VerificationFailed(
                verification.source, verification.target, list(verification.differing)
            )

        def lock_check_drop(conn: psycopg.Connection[Any]) -> None:
            conn.execute(
                sql.SQL("LOCK TABLE {s} IN ACCESS EXCLUSIVE MODE").format(s=self.source.ident)
            )
            row = conn.execute(
                sql.SQL("SELECT {ends} FROM {s}").format(ends=self._ends(), s=self.source.ident)
            ).fetchone()
            assert row is not None
            if int(row[0]) != verification.source_rows or row[2] != verification.source_max_id:
                raise CopyBackError(
                    f"{self.source} changed since verification ({verification.source_rows} "
                    f"rows then, {row[0]} now); run copy-back again"
                )
            conn.execute(sql.SQL("DROP TABLE {s}").format(s=self.source.ident))
            # Same transaction as the DROP: "dropped" is recorded if and only if it happened.
            self._mark("dropped_at")

        run_with_lock_budget(
            self.conn, "copy-back.drop",
            LockBudget(lock_timeout_ms=DROP_LOCK_TIMEOUT_MS, budget_s=LOCK_BUDGET_S),
            lock_check_drop, relations=((self.source.name, LockMode.ACCESS_EXCLUSIVE),),
            schema=self.source.schema,
        )  # fmt: skip


def finished_and_dropped(conn: psycopg.Connection[Any], spec: OutboxSpec) -> bool:
    """True when a copy-back of `spec`'s published partition ran to its end — copied,
    verified, source dropped, as its progress table records — and the source is gone.

    The runner's copy-back step counts this as proven, whoever ran the job (`outbox-migrate
    copy-back` or `run --to copy-back`)."""
    source = Relation(spec.schema, spec.published_partition)
    progress = Relation(common.STATE_SCHEMA, PROGRESS_TABLE)
    if common.exists(conn, source) or not common.exists(conn, progress):
        return False
    row = conn.execute(
        sql.SQL(
            "SELECT dropped_at IS NOT NULL AND verified_at IS NOT NULL FROM {t} "
            "WHERE source_schema = %s AND source_table = %s AND target_schema = %s "
            "AND target_table = %s"
        ).format(t=progress.ident),
        (spec.schema, spec.published_partition, spec.schema, spec.table),
    ).fetchone()
    return bool(row and row[0])


def copy_back(
    conn: psycopg.Connection[Any],
    spec: OutboxSpec,
    options: CopyBackOptions | None = None,
    *,
    dsn: str | None = None,
    drop: bool = True,
    progress: ProgressCallback | None = None,
    stop: threading.Event | None = None,
) -> tuple[CopyResult, Verification | None]:
    """The whole job: copy, verify, and drop the source when verification passes.

    Raises `VerificationFailed` (naming the differing id ranges) instead of dropping.
    Returns no verification when the copy was stopped or the source was already dropped.
    """
    job = CopyBack(conn, spec, options, dsn=dsn)
    result = job.run(progress=progress, stop=stop)
    if result.stopped or not common.exists(conn, job.source):
        return result, None
    verification = job.verify()
    if not verification.passed:
        raise VerificationFailed(
            verification.source, verification.target, list(verification.differing)
        )
    if drop:
        job.drop(verification)
    return result, verification
