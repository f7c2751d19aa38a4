"""`CdcRelay`: stream the outbox's inserts from a logical replication slot to a sink.

The loop (one thread, one replication connection, one normal session for marks):

1. read frames; collect each transaction's outbox inserts between its Begin and Commit;
2. when no more frames are waiting (or `batch_size` messages are collected, always at a
   transaction boundary) publish the collected transactions as one batch and wait for the
   broker's acknowledgement;
3. behind the stream, once per `mark_interval_s`: mark the ids acknowledged since the last
   mark (one `UPDATE … WHERE id = ANY(…)`, which moves them to the published partition,
   invisible to the stream — see `slot`), sent without waiting; the loop goes on reading and
   publishing meanwhile;
4. once that mark has committed, confirm the end position of the last transaction it covers.

A crash anywhere before step 4 makes the server send those transactions again from the slot's
confirmed position: at-least-once; duplicated are the batches acknowledged since the last
mark that committed (one mark interval's worth, plus the mark in flight and the batch being
published). When the broker is unavailable the relay marks and confirms what was acknowledged,
drops the stream, backs off and reconnects; nothing past the last acknowledged batch was
confirmed, so the server re-sends the rest.

While nothing is pending (no outbox transaction received and not yet confirmed) the relay
confirms the position the server reports in its keepalives, so the slot follows the server
and does not hold back WAL written for other tables.

First start (the slot does not exist yet): the slot is created with an exported snapshot;
the rows that snapshot shows in the unpublished partition (committed before the slot's
consistent point, e.g. left by a polling relay) are published and marked first, then the
stream starts — nothing falls in between. Completion is recorded in the publication's comment,
so a first start that dies half-way is detected and redone on the next start.
"""

from __future__ import annotations

import logging
import select
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg import sql

from outbox_migrate.config import OutboxSpec
from outbox_migrate.db import APPLICATION_NAME, one_line
from outbox_migrate.errors import ConnectError, OutboxMigrateError
from outbox_migrate.relay import queries
from outbox_migrate.relay.backoff import backoff_s
from outbox_migrate.relay.cdc import pgoutput, slot
from outbox_migrate.relay.cdc.options import CdcOptions
from outbox_migrate.relay.cdc.session import StreamSession
from outbox_migrate.relay.cdc.stream import ReplicationStream, StreamLost
from outbox_migrate.relay.errors import MessagesRejected, RelayError, SinkUnavailable
from outbox_migrate.relay.message import Message, MessageId
from outbox_migrate.relay.metrics import METRICS_INTERVAL_S, Observer
from outbox_migrate.relay.sinks import Sink, SinkFactory

log = logging.getLogger("outbox_migrate.relay")
_RETRYABLE = (StreamLost, ConnectError, psycopg.OperationalError, psycopg.InterfaceError)

CDC_APPLICATION_NAME = f"{APPLICATION_NAME} relay cdc"
MARK_STATEMENT = b"outbox_migrate_cdc_mark"
READY_COMMENT = "outbox-migrate cdc: backlog of slot {slot} published"
"""Written on the publication once the first start's backlog is out (see the module doc)."""


@dataclass
class CdcStats:
    """What a run did; read it after `run()` returns (or live, for tests)."""

    published: int = 0
    batches: int = 0
    transactions: int = 0
    backlog: int = 0
    """Rows published from the exported snapshot at the slot's creation."""
    marked: int = 0
    marks: int = 0
    """Mark statements sent (one per mark interval under steady load)."""
    dead_lettered: int = 0
    sink_failures: int = 0
    reconnects: int = 0
    idle_confirms: int = 0
    confirmed_lsn: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {k: v for k, v in vars(self).items() if not k.startswith("_")}


@dataclass
class _Columns:
    """Positions of the columns a message needs in the partition's Relation message."""

    id: int
    payload: int
    created_at: int | None
    event_type: int | None
    key: int | None
    headers: int | None
    metadata: tuple[tuple[str, int], ...]


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
        self._mark_conn: Any = None
        self._mark_sql: bytes | None = None
        self._mark_in_flight = False
        self._sink: Sink | None = None
        self.target_lsn = 0
        self._server_version = 0
        self.oldest_unconfirmed: int | None = None
        """Commit time of the oldest outbox transaction received and not yet confirmed."""
        self._present: set[str] = set()
        self._option_names = self._column_names()

    # -- lifecycle -------------------------------------------------------------------------

    def stop(self) -> None:
        """Finish the batch in flight and exit (thread- and signal-safe)."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def stop_event(self) -> threading.Event:
        return self._stop

    def run(self) -> CdcStats:
        """Stream until `stop()` (or, with `until_caught_up`, until caught up)."""
        self._prepare()
        log.info(
            "relay.started mode=cdc slot=%s publication=%s batch=%d",
            self.options.slot, self.options.publication, self.options.batch_size,
        )  # fmt: skip
        sampler = None
        if type(self.observer) is not Observer:
            sampler = threading.Thread(target=self._sample, name="relay-cdc-lag", daemon=True)
            sampler.start()
        failures = 0
        progress = -1
        try:
            while not self._stop.is_set():
                if self.stats.published != progress:
                    failures = 0  # the broker took messages since: start the backoff afresh
                    progress = self.stats.published
                try:
                    self._stream_once()  # returns when stopped or caught up
                    break
                except _Interrupted:
                    break
                except SinkUnavailable as exc:
                    self.stats.add(sink_failures=1)
                    self.observer.failed("sink")
                    log.warning("relay.sink_unavailable %s", exc)
                    self._close_sink()
                except _RETRYABLE as exc:
                    self.stats.add(reconnects=1)
                    self.observer.failed("connection")
                    log.warning("relay.connection_lost %s", one_line(str(exc)))
                    self._close_mark_conn()
                self._stop.wait(self._backoff(failures))
                failures += 1
        finally:
            self._stop.set()
            self._close_sink()
            self._close_mark_conn()
            if sampler is not None:
                sampler.join(timeout=2.0)
        log.info("relay.stopped %s", " ".join(f"{k}={v}" for k, v in self.stats.as_dict().items()))
        return self.stats

    def _backoff(self, failures: int) -> float:
        return backoff_s(
            failures, base_s=self.options.backoff_base_s, cap_s=self.options.backoff_cap_s
        )

    # -- preparation -----------------------------------------------------------------------

    def _column_names(self) -> dict[str, str | None]:
        """The optional columns' names: the option when given, else the spec's role."""
        spec = self.spec
        return {
            "event_type": self.options.event_type_column or spec.event_type_column or None,
            "key": self.options.key_column or spec.key_column or None,
            "headers": spec.headers_column or None,
        }

    def _prepare(self) -> None:
        """Check the server and tables, create the publication; the slot comes with the
        first stream (it needs the replication connection for its exported snapshot)."""
        import psycopg

        from outbox_migrate.db import connect

        spec = self.spec
        with connect(self.dsn, application_name=self.application_name) as conn:
            slot.check_wal_level(conn)
            self._server_version = conn.info.server_version
            present = {
                str(r[0])
                for r in conn.execute(
                    queries.table_columns(),
                    {"schema": spec.schema, "table": spec.unpublished_partition},
                ).fetchall()
            }
            if not present:
                raise RelayError(
                    f"--mode cdc streams the partitioned outbox; {spec.schema}."
                    f"{spec.unpublished_partition} does not exist"
                )
            if spec.id_kind != "database":
                raise RelayError("--mode cdc needs database-generated bigint ids (id_kind)")
            required = [spec.id_column, spec.payload_column, *spec.metadata_columns]
            required += [spec.created_column] if spec.created_column else []
            required += [c for c in (self.options.key_column, self.options.event_type_column) if c]
            for column in required:
                if column not in present:
                    raise RelayError(f"{self.label} has no column {column!r}")
            self._present = present
            slot.ensure_publication(
                conn, self.options.publication, spec.schema, spec.unpublished_partition
            )
            for create in (
                queries.create_dead_letter(spec.schema, self.options.dead_letter_table),
            ):
                try:
                    conn.execute(create)
                except psycopg.Error as exc:  # created concurrently, or no privilege
                    log.warning("relay.dead_letter_unavailable %s", one_line(str(exc)))
            if self.options.until_caught_up:
                row = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
                self.target_lsn = pgoutput.parse_lsn(str(row[0])) if row else 0

    def columns_for(self, relation: pgoutput.Relation) -> _Columns:
        names = {name: i for i, name in enumerate(relation.columns)}
        spec = self.spec
        optional = self._option_names
        try:
            return _Columns(
                id=names[spec.id_column],
                payload=names[spec.payload_column],
                created_at=names[spec.created_column] if spec.created_column else None,
                event_type=names.get(optional["event_type"] or ""),
                key=names.get(optional["key"] or ""),
                headers=names.get(optional["headers"] or ""),
                metadata=tuple((c, names[c]) for c in spec.metadata_columns),
            )
        except KeyError as exc:
            raise RelayError(f"{self.label} has no column {exc.args[0]}") from None

    # -- the stream ------------------------------------------------------------------------

    def _stream_once(self) -> None:
        """One replication connection's life: (first start: create the slot and publish
        its backlog), then stream until stopped or the connection breaks."""
        from outbox_migrate.db import connect

        options = self.options
        stream = ReplicationStream(self.dsn, self.application_name)
        try:
            with connect(self.dsn, application_name=self.application_name) as conn:
                database = conn.info.dbname
                state = slot.slot_state(conn, options.slot)
                ready = self._backlog_done(conn)
                if state is not None and not ready:
                    # A first start died before its backlog was out: start over (the rows it
                    # did publish were marked, so they are not published again).
                    log.warning("relay.cdc_backlog_redo slot=%s", options.slot)
                    slot.drop_slot(conn, options.slot)
                    state = None
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
                    self._publish_backlog(conn, snapshot)
                    self._set_backlog_done(conn)
                elif state.plugin != "pgoutput" or state.database != database:
                    raise RelayError(
                        f"replication slot {options.slot} is not a pgoutput slot of database "
                        f"{database}: choose another --slot"
                    )
            stream.start(options.slot, options.publication)
            StreamSession(self, stream).run()
        finally:
            stream.close()

    def _backlog_done(self, conn: Any) -> bool:
        row = conn.execute(
            "SELECT obj_description(oid, 'pg_publication') FROM pg_publication WHERE pubname = %s",
            (self.options.publication,),
        ).fetchone()
        return bool(row) and row[0] == READY_COMMENT.format(slot=self.options.slot)

    def _set_backlog_done(self, conn: Any) -> None:
        conn.execute(
            sql.SQL("COMMENT ON PUBLICATION {} IS {}").format(
                sql.Identifier(self.options.publication),
                sql.Literal(READY_COMMENT.format(slot=self.options.slot)),
            )
        )

    def _publish_backlog(self, conn: Any, snapshot: str) -> None:
        """Publish the rows the slot's exported snapshot shows in the unpublished partition."""
        spec = self.spec
        names = sorted(self._present)
        columns = self.columns_for(pgoutput.Relation(0, spec.schema, "", tuple(names)))
        select = sql.SQL("SELECT {} FROM {} ORDER BY {}").format(
            sql.SQL(", ").join(sql.SQL("{}::text").format(sql.Identifier(n)) for n in names),
            sql.Identifier(spec.schema, spec.unpublished_partition),
            sql.Identifier(spec.id_column),
        )
        with conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot)))
            with conn.cursor(name="outbox_cdc_backlog") as cursor:
                cursor.execute(select)
                while not self._stop.is_set():
                    rows = cursor.fetchmany(self.options.batch_size)
                    if not rows:
                        break
                    batch = [self.message(columns, tuple(r)) for r in rows]
                    self.deliver(batch)
                    self.mark([m.id for m in batch])
                    self.stats.add(backlog=len(batch), published=len(batch), batches=1)
                    self.observer.published(len(batch))
        if self._stop.is_set():
            raise _Interrupted

    def message(self, columns: _Columns, values: Sequence[str | None]) -> Message:
        created = values[columns.created_at] if columns.created_at is not None else None
        # pgoutput's text ("2026-01-02 03:04:05.6+00") as RFC 3339, like the polling claim's
        created_at = datetime.fromisoformat(created) if created else datetime.now(UTC)
        extra: tuple[tuple[str, str], ...] = ()
        if columns.headers is not None or columns.metadata:
            extra = _extra_headers(columns, values)
        return Message(
            int(values[columns.id] or 0),
            self.label,
            values[columns.event_type] if columns.event_type is not None else None,
            values[columns.key] if columns.key is not None else None,
            values[columns.payload] or "null",
            created_at.isoformat(),
            extra,
        )

    # -- broker and marks ------------------------------------------------------------------

    def deliver(self, batch: list[Message]) -> None:
        """Publish until every message is acknowledged or dead-lettered; `SinkUnavailable`
        propagates (the caller drops the stream: nothing of this batch is confirmed)."""
        if self._sink is None:
            self._sink = self.sink_factory()
        todo = batch
        for attempt in range(1, self.options.max_attempts + 1):
            try:
                self._sink.publish(todo)
                return
            except MessagesRejected as exc:
                self.observer.failed("rejected", len(exc.rejected))
                refused = [m for m in todo if m.id in exc.rejected]
                if attempt == self.options.max_attempts:
                    self._dead_letter(refused, attempt, exc.rejected)
                    return
                log.warning("relay.rejected count=%d attempt=%d", len(refused), attempt)
                todo = refused
                if self._stop.wait(self._backoff(attempt - 1)):
                    raise _Interrupted from None

    def _dead_letter(
        self, messages: list[Message], attempts: int, errors: Mapping[MessageId, str]
    ) -> None:
        self.wait_mark()  # the marks session carries one statement at a time
        conn = self._marks()
        statement = queries.insert_dead_letter(self.spec.schema, self.options.dead_letter_table)
        with conn.transaction():
            for m in messages:
                conn.execute(
                    statement,
                    {"source": m.table, "id": m.id, "event_type": m.event_type, "key": m.key,
                     "payload": m.payload, "created_at": m.created_at, "attempts": attempts,
                     "error": errors.get(m.id, "")[:2000]},
                )  # fmt: skip
        self.stats.add(dead_lettered=len(messages))
        log.warning("relay.dead_lettered count=%d attempts=%d", len(messages), attempts)

    def mark(self, ids: Sequence[MessageId]) -> None:
        """Mark and wait (the first start's backlog; the stream sends its marks without
        waiting, see `send_mark`)."""
        if self.send_mark(ids):
            self.wait_mark()

    def send_mark(self, ids: Sequence[MessageId]) -> bool:
        """Send one statement for `ids` without waiting for it (the rows leave the
        unpublished partition); False when there is nothing to send. At most one mark is in
        flight: `mark_done`/`wait_mark` collect its result before the next is sent."""
        if not self.options.mark or not ids:
            return False
        if self._mark_in_flight:
            raise RuntimeError("a mark is already in flight")  # a bug, not an input error
        conn = self._marks()
        pgconn = conn.pgconn
        if self._mark_sql is None:
            # Prepared once and run through libpq directly: composing and adapting through
            # the cursor API cost ~300 µs of CPU per batch, more than the rest of the loop
            # (measured at one batch per transaction, the steady state at 1,000 msg/s).
            spec = self.spec
            self._mark_sql = (
                sql.SQL("UPDATE {} SET {} = now() WHERE {} = ANY($1::int8[]) AND {} IS NULL")
                .format(
                    sql.Identifier(spec.schema, spec.partitioned_table),
                    sql.Identifier(spec.published_column),
                    sql.Identifier(spec.id_column),
                    sql.Identifier(spec.published_column),
                )
                .as_bytes(conn)
            )
            self._check(pgconn.prepare(MARK_STATEMENT, self._mark_sql), pgconn)
        # The ids as one int8[] literal: no per-element adaptation.
        literal = ("{" + ",".join(map(str, ids)) + "}").encode()
        try:
            pgconn.send_query_prepared(MARK_STATEMENT, [literal])
            while pgconn.flush() == 1:  # the statement did not fit the socket buffer
                select.select([pgconn.socket], [pgconn.socket], [], 1.0)
        except psycopg.Error as exc:
            raise psycopg.OperationalError(one_line(str(exc))) from None
        self._mark_in_flight = True
        self.stats.add(marks=1)
        return True

    @property
    def mark_in_flight(self) -> bool:
        return self._mark_in_flight

    def mark_socket(self) -> int | None:
        """The marks session's socket while a mark is in flight (the stream loop also
        waits on it, so a mark's result is collected as soon as it arrives)."""
        if not self._mark_in_flight or self._mark_conn is None:
            return None
        fd: int = self._mark_conn.pgconn.socket
        return fd

    def mark_done(self) -> bool:
        """Collect the mark in flight if its result has arrived (never blocks)."""
        if not self._mark_in_flight:
            return True
        pgconn = self._mark_conn.pgconn
        try:
            pgconn.consume_input()
        except psycopg.Error as exc:
            raise psycopg.OperationalError(one_line(str(exc))) from None
        if pgconn.is_busy():
            return False
        self._collect_mark(pgconn)
        return True

    def wait_mark(self) -> None:
        """Block until the mark in flight has committed."""
        while not self.mark_done():
            select.select([self._mark_conn.pgconn.socket], [], [], 1.0)

    def _collect_mark(self, pgconn: Any) -> None:
        self._mark_in_flight = False
        result = pgconn.get_result()
        while pgconn.get_result() is not None:  # drain to the end of the statement
            pass
        if result is None:
            raise psycopg.OperationalError(
                pgconn.error_message.decode(errors="replace").strip() or "mark: no result"
            )
        result = self._check(result, pgconn)
        self.stats.add(marked=max(result.command_tuples or 0, 0))

    @staticmethod
    def _check(result: Any, pgconn: Any) -> Any:
        from psycopg import pq

        if result.status != pq.ExecStatus.COMMAND_OK:
            message = (result.error_message or pgconn.error_message).decode(errors="replace")
            if pgconn.status != pq.ConnStatus.OK:
                raise psycopg.OperationalError(message.strip())
            raise RelayError(f"cannot mark published rows: {message.strip()}")
        return result

    def _marks(self) -> Any:
        if self._mark_conn is None or self._mark_conn.closed:
            from outbox_migrate.db import connect

            self._mark_conn = connect(self.dsn, application_name=self.application_name)
        return self._mark_conn

    def _close_mark_conn(self) -> None:
        if self._mark_conn is not None:
            try:
                self._mark_conn.close()
            except Exception:  # closing a broken connection may fail too
                log.debug("relay.close_failed", exc_info=True)
            self._mark_conn = None
            self._mark_sql = None
            self._mark_in_flight = False

    def _close_sink(self) -> None:
        if self._sink is not None:
            try:
                self._sink.close()
            except Exception:  # a broken sink is replaced, not fatal
                log.debug("relay.sink_close_failed", exc_info=True)
            self._sink = None

    # -- slot lag --------------------------------------------------------------------------

    def _sample(self) -> None:
        """Slot lag (bytes behind the server, seconds since the oldest unconfirmed commit)
        and activity, for the metrics, readiness and a warning log line."""
        from outbox_migrate.db import connect

        warned = False
        while not self._stop.is_set():
            try:
                with connect(self.dsn, application_name=self.application_name) as conn:
                    while not self._stop.is_set():
                        state = slot.slot_state(conn, self.options.slot)
                        if state is not None:
                            over = self._report_lag(state)
                            if over and not warned:
                                log.warning(
                                    "relay.cdc_slot_lag slot=%s bytes=%d (warning at %d)",
                                    state.name, state.lag_bytes, self.options.lag_warn_bytes,
                                )  # fmt: skip
                            warned = over
                        self._stop.wait(METRICS_INTERVAL_S)
            except _RETRYABLE:
                self._stop.wait(METRICS_INTERVAL_S)

    def _report_lag(self, state: slot.SlotState) -> bool:
        report = getattr(self.observer, "slot", None)
        oldest = self.oldest_unconfirmed
        lag_s = 0.0
        if oldest is not None:
            lag_s = (datetime.now(UTC) - pgoutput.pg_time(oldest)).total_seconds()
        if report is not None:
            report(state.lag_bytes, lag_s, state.active)
        return state.lag_bytes > self.options.lag_warn_bytes or lag_s > self.options.lag_warn_s


def _extra_headers(columns: _Columns, values: Sequence[str | None]) -> tuple[tuple[str, str], ...]:
    """The headers column's entries (a JSON object), then the metadata columns, as the
    polling relay sends them."""
    import json

    out: dict[str, str] = {}
    raw = values[columns.headers] if columns.headers is not None else None
    if raw:
        parsed = json.loads(raw)
        if isinstance(parsed, dict):
            for key, value in parsed.items():
                if value is not None:
                    out[str(key)] = value if isinstance(value, str) else json.dumps(value)
    for name, index in columns.metadata:  # a metadata column wins over a same-named entry
        value = values[index]
        if value is not None:
            out[name] = value
    return tuple(out.items())


class _Interrupted(OutboxMigrateError):
    """Stopped while waiting inside a batch: leave without confirming it."""


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
