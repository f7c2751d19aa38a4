"""`CdcRelay`: stream the outbox's inserts from a logical replication slot to a sink.

It wires the parts together (docs/relay.md, "CDC mode"); it must never confirm a position
whose rows were not acknowledged and marked, nor stream or drop another database's slot.
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg import sql

from outbox_migrate.config import OutboxSpec
from outbox_migrate.db import APPLICATION_NAME, one_line
from outbox_migrate.errors import ConnectError, RelayError, RelayFailed, SinkUnavailable
from outbox_migrate.patterns import marker_catalog
from outbox_migrate.relay import library_logs, queries
from outbox_migrate.relay.bad_rows import FailedMessages
from outbox_migrate.relay.cdc import pgoutput, slot
from outbox_migrate.relay.cdc.delivery import Delivery, Interrupted
from outbox_migrate.relay.cdc.marks import MarkRepair, MarkSession
from outbox_migrate.relay.cdc.messages import MessageBuilder, RowReader
from outbox_migrate.relay.cdc.session import StreamSession
from outbox_migrate.relay.cdc.stream import ReplicationStream, StreamLost
from outbox_migrate.relay.marker_source import with_oid
from outbox_migrate.relay.metrics import Observer, start_sampler
from outbox_migrate.relay.options import CdcOptions
from outbox_migrate.relay.run_stats import CdcStats, Unconfirmed, count_failures
from outbox_migrate.relay.shared import connection_errors
from outbox_migrate.relay.sinks import SinkFactory
from outbox_migrate.sql import query

__all__ = ["CdcRelay", "CdcStats", "running"]

log = logging.getLogger("outbox_migrate.relay")
_RETRYABLE = connection_errors(StreamLost, ConnectError)

CDC_APPLICATION_NAME = f"{APPLICATION_NAME} relay cdc"
READY_COMMENT = "outbox-migrate cdc: backlog of slot {slot} published"
RUN_SOURCE = "cdc-run:{slot}"
"""`source_table` of a run's row in the attempts table, kept from start to clean stop: found at
a start, the last run died (maybe of what it was publishing). Never a table's label."""


class CdcRelay:
    """Publishes the partitioned outbox from a logical replication slot through a sink."""

    def __init__(
        self,
        dsn: str,
        sink_factory: SinkFactory,
        *,
        spec: OutboxSpec | None = None,
        options: CdcOptions | None = None,
        observer: Observer | None = None,
        application_name: str = CDC_APPLICATION_NAME,
    ) -> None:
        self.dsn = dsn
        self.spec = spec or OutboxSpec()
        self.options = options or CdcOptions()
        self.sink_factory = sink_factory
        self.observer = observer or Observer()
        self.application_name = application_name
        self.label = f"{self.spec.schema}.{self.spec.partitioned_table}"
        self.stats = CdcStats()
        self._stop = threading.Event()
        self.builder = MessageBuilder(self.spec, self.options)
        options = self.options
        self.failures = FailedMessages(
            self.spec.schema, options.dead_letter_table, options.attempts_table,
            options.max_attempts, text_ids=False,  # --mode cdc takes bigint ids only
        )  # fmt: skip
        self.repair = MarkRepair(
            failures=self.failures, label=self.label, reader=self._row_reader, stats=self.stats,
            observer=self.observer,
        )  # fmt: skip
        self.marks = MarkSession(
            connect=self._connect, source=queries.partitioned_source(self.spec),
            enabled=options.mark, stats=self.stats, repair=self.repair,
        )  # fmt: skip
        self._delivery: Delivery | None = None
        self.careful_until = 0
        """Set when the last run died without a trace: until the stream passes this position,
        each attempt is counted before the publish (`Delivery.deliver(careful=True)`)."""
        self._run_recorded = False
        self.target_lsn = 0
        self._server_version = 0
        self.unconfirmed = Unconfirmed()
        self._present: set[str] = set()
        self._backlog: tuple[int, IdRuns] | None = None
        """Consistent point and ids of the slot this process created, until done."""
        self._lag_over = False
        """The slot's lag was over a warning threshold at the last sample."""

    # -- lifecycle -------------------------------------------------------------------------

    def stop(self) -> None:
        """Finish the batch in flight and exit (thread- and signal-safe)."""
        self._stop.set()

    def run(self) -> CdcStats:
        """Stream until `stop()` (or, with `until_caught_up`, until caught up)."""
        library_logs.route()  # a broker library's traceback becomes one log line
        self._prepare()
        log.info(
            "relay.started mode=cdc slot=%s publication=%s batch=%d",
            self.options.slot, self.options.publication, self.options.batch_size,
        )  # fmt: skip
        sampler = start_sampler(self.observer, self._stop, self._connect, self._sample,
                                "relay-cdc-lag")  # fmt: skip
        failures = 0
        progress = -1
        clean = False
        try:
            while not self._stop.is_set():
                if self.stats.published != progress:
                    failures = 0  # the broker took messages since: start the backoff afresh
                    progress = self.stats.published
                try:
                    self._stream_once()  # returns when stopped or caught up
                    break
                except Interrupted:
                    break
                except SinkUnavailable as exc:
                    count_failures(self.stats, self.observer, sink=1)
                    log.warning("relay.sink_unavailable %s", " ".join(str(exc).split()))
                    self.delivery.close()
                except _RETRYABLE as exc:
                    self.stats.add(reconnects=1)
                    self.observer.failed("connection")
                    log.warning("relay.connection_lost %s", one_line(str(exc)))
                    self.marks.close()
                self._stop.wait(self.options.backoff(failures))
                failures += 1
            clean = True
        finally:
            self._stop.set()
            self.delivery.close()
            self.marks.close()
            if clean:
                self._end_run()
            if sampler is not None:
                sampler.join(timeout=2.0)
        log.info("relay.stopped %s", " ".join(f"{k}={v}" for k, v in self.stats.as_dict().items()))
        return self.stats

    @property
    def delivery(self) -> Delivery:
        """Built on first use: tests may swap the observer after construction."""
        if self._delivery is None:
            self._delivery = Delivery(
                sink_factory=self.sink_factory, failures=self.failures, label=self.label,
                marks=self.marks, stats=self.stats, observer=self.observer, stop=self._stop,
                backoff=self.options.backoff, bad=self.builder.bad,
            )  # fmt: skip
        return self._delivery

    def _run_row(self, conn: Any, statement: str) -> Any:
        """This run's row (`RUN_SOURCE`): "begin-run" records it, "end-run" removes it."""
        table = sql.Identifier(self.spec.schema, self.failures.attempts_table)
        source = RUN_SOURCE.format(slot=self.options.slot)
        return conn.execute(query("cdc", statement).compose(table=table), (source,))

    def _begin_run(self, conn: Any) -> bool:
        """Record this run; True when the last one died without a trace."""
        try:
            row = self._run_row(conn, "begin-run").fetchone()
        except psycopg.errors.InsufficientPrivilege as exc:
            log.warning("relay.cdc_run_unrecorded %s", one_line(str(exc)))
            return False
        self._run_recorded = True
        return bool(row) and int(row[0]) > 1

    def _end_run(self) -> None:
        """Stopped cleanly: the next start need not count before publishing."""
        if not self._run_recorded:
            return
        try:
            with self._connect() as conn:
                self._run_row(conn, "end-run")
        except (psycopg.Error, ConnectError) as exc:  # the next start is careful, no more
            log.warning("relay.cdc_run_not_closed %s", one_line(str(exc)))

    def _connect(self) -> Any:
        from outbox_migrate.db import connect

        return connect(self.dsn, application_name=self.application_name)

    # -- preparation -----------------------------------------------------------------------

    def _prepare(self) -> None:
        """Check the server and tables, create the publication and dead-letter tables; the
        slot comes with the first stream (it needs the replication connection's snapshot)."""
        with self._connect() as conn:
            spec = self.spec = marker_catalog.resolve(conn, self.spec)
            slot.check_wal_level(conn)
            slot.check_replication(conn)
            self._server_version = conn.info.server_version
            present = {
                str(r[0])
                for r in conn.execute(
                    queries.named("table-columns"),
                    {"schema": spec.schema, "table": spec.unpublished_partition},
                ).fetchall()
            }
            if not present:
                raise RelayError(
                    f"--mode cdc streams the partitioned outbox; {spec.schema}."
                    f"{spec.unpublished_partition} does not exist"
                )
            self.marks.use_source(with_oid(conn, queries.partitioned_source(spec)))
            if spec.id_kind != "database":
                raise RelayError("--mode cdc needs database-generated bigint ids (id_kind)")
            required = [spec.id_column, spec.payload_column, *spec.metadata_columns]
            required += [spec.created_column] if spec.created_column else []
            required += [c for c in (self.options.key_column, self.options.event_type_column) if c]
            for column in required:
                if column not in present:
                    raise RelayError(f"{self.label} has no column {column!r}")
            self._present = present
            state = slot.slot_state(conn, self.options.slot)
            if state is not None:
                slot.check_owned(state, conn.info.dbname)
                slot.wait_inactive(conn, self.options.slot)
            slot.ensure_publication(
                conn, self.options.publication, spec.schema, spec.unpublished_partition
            )
            self.failures.prepare(conn, [self.label])
            row = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
            start_lsn = pgoutput.parse_lsn(str(row[0])) if row else 0
            if self.options.until_caught_up:
                self.target_lsn = start_lsn
            if self.failures.available and self._begin_run(conn):
                # The last run died without a trace: what it was publishing may have killed it.
                log.warning(
                    "relay.cdc_unclean_stop slot=%s: counting attempts before each publish "
                    "until the stream passes %s", self.options.slot, pgoutput.lsn_text(start_lsn),
                )  # fmt: skip
                self.careful_until = start_lsn

    # -- the stream ------------------------------------------------------------------------

    def _stream_once(self) -> None:
        """One replication connection's life: the first start's slot and backlog, then
        stream until stopped or the connection breaks."""
        options = self.options
        stream = ReplicationStream(self.dsn, self.application_name)
        try:
            with self._connect() as conn:
                state = slot.slot_state(conn, options.slot)
                if state is not None:
                    slot.check_owned(state, conn.info.dbname)
                runs: IdRuns | None = None
                if state is not None and not self._backlog_done(conn):
                    runs = self._kept_backlog(state)
                    if runs is None:
                        # A first start died before its backlog was out: start over.
                        log.warning("relay.cdc_backlog_redo slot=%s", options.slot)
                        slot.drop_slot(conn, options.slot)
                        state = None
                    else:  # this process's own first start, after a back-off: go on
                        log.info("relay.cdc_backlog_resumed slot=%s", options.slot)
                if state is None:
                    failover = (
                        options.failover and self._server_version >= slot.FAILOVER_MIN_VERSION
                    )
                    point, snapshot = stream.create_slot(
                        options.slot, failover=failover, server_version=self._server_version
                    )
                    log.info(
                        "relay.cdc_slot_created slot=%s at=%s failover=%s",
                        options.slot, pgoutput.lsn_text(point), failover,
                    )  # fmt: skip
                    runs = snapshot_ids(conn, snapshot, self.spec)
                    stream.release_snapshot()  # the walsender's xmin goes with it
                    self._backlog = (point, runs)
                if runs is not None:
                    self._publish_backlog(conn, runs)
                    # Failed marks settle before the backlog counts as done.
                    self.marks.settle(self._stop)
                    if self._stop.is_set():
                        raise Interrupted
                    if self.marks.unresolved:
                        raise RelayFailed(
                            "rows of the backlog are locked by another session and cannot be "
                            "marked; the next start publishes the rest of the backlog again"
                        )
                    self._set_backlog_done(conn)
                    self._backlog = None
            stream.start(options.slot, options.publication)
            StreamSession(
                stream=stream, options=options, builder=self.builder, delivery=self.delivery,
                mark_session=self.marks, stats=self.stats, observer=self.observer, stop=self._stop,
                target_lsn=self.target_lsn, unconfirmed=self.unconfirmed,
                careful_until=self.careful_until,
            ).run()  # fmt: skip
        finally:
            stream.close()

    def _publish_backlog(self, conn: Any, runs: IdRuns) -> None:
        """Publish and mark the backlog batch by batch, each read by id in its own statement
        (autocommit: its own transaction), none open while publishing; a row marked meanwhile
        is not found again."""
        reader = self._row_reader(conn)
        for ids in chunks(runs, self.options.batch_size):
            if self._stop.is_set():
                raise Interrupted
            batch = reader.by_ids(conn, ids)
            if batch:
                self.delivery.deliver(batch, careful=self.careful_until > 0)
                self.marks.mark([m.id for m in batch])
                self.stats.add(backlog=len(batch), published=len(batch), batches=1)
                self.observer.published(len(batch))
        if self._stop.is_set():
            raise Interrupted

    def _row_reader(self, conn: Any) -> RowReader:
        """Rows of the unpublished partition as the stream sends them."""
        return RowReader(conn, self.spec, sorted(self._present), self.builder)

    def _kept_backlog(self, state: slot.SlotState) -> IdRuns | None:
        """The kept backlog ids while the slot is still the one this process created (never
        streamed), rather than a new slot per sink back-off, each waiting for the transactions
        running at its creation."""
        if self._backlog is None or state.confirmed_lsn is None:
            return None
        point, runs = self._backlog
        return runs if pgoutput.parse_lsn(state.confirmed_lsn) == point else None

    def _backlog_done(self, conn: Any) -> bool:
        row = conn.execute(
            "SELECT obj_description(oid, 'pg_publication') FROM pg_publication WHERE pubname = %s",
            (self.options.publication,),
        ).fetchone()
        return bool(row) and row[0] == READY_COMMENT.format(slot=self.options.slot)

    def _set_backlog_done(self, conn: Any) -> None:
        conn.execute(
            query("cdc", "comment-publication").compose(
                publication=sql.Identifier(self.options.publication),
                comment=sql.Literal(READY_COMMENT.format(slot=self.options.slot)),
            )
        )

    # -- slot lag --------------------------------------------------------------------------

    def _sample(self, conn: Any) -> None:
        """Slot lag and activity for the metrics, readiness and a warning log line (as the lag
        goes over a threshold)."""
        state = slot.slot_state(conn, self.options.slot)
        if state is None:
            return
        oldest = self.unconfirmed.commit_time
        lag_s = 0.0
        if oldest is not None:
            lag_s = (datetime.now(UTC) - pgoutput.pg_time(oldest)).total_seconds()
        self.observer.slot(state.lag_bytes, lag_s, state.active)
        over = state.lag_bytes > self.options.lag_warn_bytes or lag_s > self.options.lag_warn_s
        if over and not self._lag_over:
            log.warning(
                "relay.cdc_slot_lag slot=%s bytes=%d (warning at %d)",
                state.name, state.lag_bytes, self.options.lag_warn_bytes,
            )  # fmt: skip
        self._lag_over = over


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


def snapshot_ids(conn: Any, snapshot: str, spec: OutboxSpec) -> IdRuns:
    """The ids the exported snapshot shows in the unpublished partition: the backlog, no gap
    and no overlap with the stream. One short transaction, no broker in it: its xmin holds
    back VACUUM."""
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


@contextmanager
def running(relay: CdcRelay) -> Iterator[threading.Thread]:
    """Run a CDC relay in a background thread for the duration of a `with` block (tests)."""
    thread = threading.Thread(target=relay.run, name="relay-cdc", daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        relay.stop()
        thread.join(timeout=30)
