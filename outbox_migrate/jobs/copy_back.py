"""HOPER's copy-back: copy the detached published partition into the old table, verify, drop
(docs/copy-back.md). It must never drop a source whose rows are not all, identically, in the
target.
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
from outbox_migrate.db import try_session_lock
from outbox_migrate.errors import OutboxMigrateError, RunnerBusy, SchemaError, UsageError
from outbox_migrate.jobs import common
from outbox_migrate.jobs.common import Relation
from outbox_migrate.jobs.copy_back_ids import CopyIds, IdValue
from outbox_migrate.jobs.copy_back_state import PROGRESS_TABLE, ProgressTable, finished_and_dropped
from outbox_migrate.jobs.copy_back_verify import (
    RangeCheck,
    Verification,
    VerificationFailed,
    verify_ranges,
)
from outbox_migrate.jobs.throttle import Impact, LatencyProbe, Throttle, ThrottlePolicy
from outbox_migrate.lock_budget import LockMode

DEFAULT_BATCH_ROWS = 10_000
"""Rows per batch: large enough to amortise the round trip, small enough for short locks."""
DEFAULT_VERIFY_RANGE_IDS = 100_000
"""Width, in ids, of one verification range (one short query each)."""
RATE_WINDOW_S = 5.0
"""Window over which the reported rows/s (and so the ETA) is measured."""

__all__ = [
    "PROGRESS_TABLE", "CopyBack", "CopyBackError", "CopyBackOptions",
    "CopyPlan", "CopyProgress", "CopyResult", "IdValue", "RangeCheck", "Verification",
    "VerificationFailed", "copy_back", "finished_and_dropped",
]  # fmt: skip


class CopyBackError(OutboxMigrateError):
    """The copy-back cannot proceed in the current state (names what is wrong)."""


@dataclass(frozen=True)
class CopyBackOptions:
    batch_rows: int = DEFAULT_BATCH_ROWS
    verify_range_ids: int = DEFAULT_VERIFY_RANGE_IDS
    throttle: ThrottlePolicy = field(default_factory=ThrottlePolicy)
    from_start: bool = False
    """Walk the whole source again (`CopyBack.run`): an option of the job, so the runner's
    copy-back step honours it too (it was the CLI's alone, and ignored through the ledger)."""


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
        self.progress = ProgressTable(conn, self.source, self.target)
        self.index_name = common.fit_identifier(spec.published_partition, "_copy_back_id_idx")
        self.ids = CopyIds(conn, spec, self.source)
        """Integer and application ids alike: carried as text, cast back to the id's type."""

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
        state = self.progress.read()
        if not common.exists(self.conn, self.source):
            if state is not None and state["dropped_at"] is not None:
                return CopyPlan(str(self.source), str(self.target), (), 0, None, None,
                                self.ids.value(state["high_water"]), 0, False, "done")  # fmt: skip
            raise SchemaError(
                f"copy-back source {self.source} does not exist and no finished copy-back "
                "of it is recorded"
            )
        cols = self._check_shape()
        total, lowest, highest = self.ids.ends(self.conn)
        lo, hi = self.ids.value(lowest), self.ids.value(highest)
        high_water = state["high_water"] if state and state["dropped_at"] is None else None
        if high_water is None:
            remaining = total
        else:
            rem = self.conn.execute(
                sql.SQL("SELECT count(*) FROM {s} WHERE {id} > {after}").format(
                    id=self.ids.column, s=self.source.ident, after=self.ids.bound("after")
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
            high_water=self.ids.value(high_water),
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
            i=sql.Identifier(self.index_name), s=self.source.ident, id=self.ids.column
        )
        common.ddl_under_budget(self.conn, "copy-back.source-index", self.source, LockMode.SHARE,
                                lambda conn: conn.execute(statement))  # fmt: skip

    def _batch_statement(self, cols: tuple[str, ...], *, first: bool = False) -> sql.Composed:
        """One keyset batch and its high-water mark, as one statement (one transaction): the
        rows and the mark that covers them commit together, so a kill at any point leaves a
        mark that is exact. The first batch has no lower bound (no id lies below every uuid,
        and `$1 IS NULL OR id > $1` would defeat the index); the mark is the batch's last id
        as text."""
        ids = self.ids
        after = (
            sql.SQL("")
            if first
            else sql.SQL(" WHERE {id} > {after}").format(id=ids.column, after=ids.bound("after"))
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
            " UPDATE {progress} p SET high_water_id = s.hw, high_water = {integer_mark},"
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
            id=ids.column,
            out=ids.out(),
            integer_mark=ids.integer_mark("s.hw"),
            progress=self.progress.rel.ident,
        )

    def _start_probe(self) -> LatencyProbe | None:
        if not self.options.throttle.adaptive or self.dsn is None:
            return None
        probe = LatencyProbe(
            self.dsn,
            sql.Identifier(self.spec.schema, self.spec.unpublished_partition),
            self.ids.column,
        )
        try:
            probe.start()
        except (OutboxMigrateError, psycopg.Error):
            probe.stop()
            return None  # nothing to probe (no unpublished partition): the rate still holds
        return probe

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
        `RunnerBusy` instead of copying the same batches in parallel.
        """
        # A plan the caller just made saves counting the source twice (a full scan).
        plan = plan or self.plan()
        if plan.state == "done":
            return CopyResult(0, 0, 0, 0.0, 0.0, plan.high_water, plan.high_water, False)
        with try_session_lock(self.conn, self.lock_key) as locked:
            if not locked:
                busy = f"another copy-back of {self.source} into {self.target} is running"
                raise RunnerBusy(busy)
            return self._run(plan, progress, stop, from_start)

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
        self.progress.ensure()  # created or upgraded once, at the job's start
        self.ensure_source_index()
        state = self.progress.start(plan.source_rows)
        high_water: str | None = None if from_start else state["high_water"]
        resumed_from = high_water
        already = 0 if from_start else int(state["rows_inserted"]) + int(state["rows_present"])
        remaining = plan.source_rows if from_start else plan.remaining_rows
        total = max(plan.source_rows, already + remaining)
        statement = self._batch_statement(plan.columns)
        first_batch = self._batch_statement(plan.columns, first=True)
        key = dict(zip(("ss", "st", "ts", "tt"), self.progress.key, strict=True))

        probe = self._start_probe()
        throttle = Throttle(self.conn, self.options.throttle, probe)
        started = time.monotonic()
        meter = RateMeter(started)
        inserted = present = batches = 0
        stopped = False
        try:
            while True:
                if stop is not None and stop.is_set():
                    stopped = True
                    break
                row = self.conn.execute(
                    # No mark yet: the first batch, without a lower bound.
                    first_batch if high_water is None else statement,
                    {"after": high_water, "limit": self.options.batch_rows, **key},
                ).fetchone()
                assert row is not None
                count, batch_high, batch_inserted = int(row[0]), row[1], int(row[2])
                if count == 0:
                    break
                batches += 1
                inserted += batch_inserted
                present += count - batch_inserted
                high_water = str(batch_high)
                done = inserted + present
                pause = throttle.wait(done, stop)
                if progress is not None:
                    rate = meter.add(done)
                    left = max(0, total - already - done)
                    progress(
                        CopyProgress(
                            copied_rows=already + done,
                            total_rows=total,
                            high_water=self.ids.value(high_water),
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
            self.progress.stamp("copied_at")
        return CopyResult(
            inserted_rows=inserted,
            present_rows=present,
            batches=batches,
            elapsed_s=time.monotonic() - started,
            paused_s=throttle.paused_s,
            high_water=self.ids.value(high_water),
            resumed_from=self.ids.value(resumed_from),
            stopped=stopped,
        )

    # -- verify ----------------------------------------------------------------------------

    def verify(self) -> Verification:
        """Compare every source row with the target, one bounded range per query
        (copy_back_verify.py); stamps `verified_at` when every row matched."""
        if not common.exists(self.conn, self.source):
            raise CopyBackError(f"{self.source} does not exist: nothing to verify")
        cols = self._check_shape()
        result = verify_ranges(
            self.conn, self.ids, self.source, self.target, cols, self.options.verify_range_ids
        )
        if result.passed:
            self.progress.stamp("verified_at")
        return result

    # -- drop ------------------------------------------------------------------------------

    def drop(self, verification: Verification) -> None:
        """Drop the source, only after a verification that passed and still holds.

        The source is locked first (bounded by lock_timeout) and its row count and max id
        compared with what was verified, so rows written to it after verification cannot be
        dropped unseen.
        """
        verification.check()

        def lock_check_drop(conn: psycopg.Connection[Any]) -> None:
            conn.execute(
                sql.SQL("LOCK TABLE {s} IN ACCESS EXCLUSIVE MODE").format(s=self.source.ident)
            )
            rows, _, highest = self.ids.ends(conn)
            if rows != verification.source_rows or (
                self.ids.value(highest) != verification.source_max_id
            ):
                raise CopyBackError(
                    f"{self.source} changed since verification ({verification.source_rows} "
                    f"rows then, {rows} now); run copy-back again"
                )
            conn.execute(sql.SQL("DROP TABLE {s}").format(s=self.source.ident))
            # Same transaction as the DROP: "dropped" is recorded if and only if it happened.
            self.progress.stamp("dropped_at")

        common.ddl_under_budget(self.conn, "copy-back.drop", self.source,
                                LockMode.ACCESS_EXCLUSIVE, lock_check_drop)  # fmt: skip


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
    result = job.run(progress=progress, stop=stop, from_start=job.options.from_start)
    if result.stopped or not common.exists(conn, job.source):
        return result, None
    verification = job.verify()
    verification.check()
    if drop:
        job.drop(verification)
    return result, verification
