"""The worker's hot path at the libpq level: prepared statements in one pipeline, a batch's in
one network write (docs/relay.md, "Accelerators"). Still psycopg's connection, row loading and
error classes; values go as text of unknown type, as psycopg sends `str`.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import re
import select
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from psycopg import errors as pg_errors
from psycopg import pq
from psycopg.adapt import Transformer

log = logging.getLogger("outbox_migrate.relay")

_NAMES = itertools.count()
"""Unique in the process: a new `Wire` on a session must not collide with an earlier one's."""
_PLACEHOLDER = re.compile(rb"%\((\w+)\)s|%%")
_ENDS_BLOCK = (b"COMMIT", b"ROLLBACK")
_OK = (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK)
_SYNCED = pq.ExecStatus.PIPELINE_SYNC
_FAILED = pq.ExecStatus.FATAL_ERROR
_POLL_IN = select.POLLIN | select.POLLERR | select.POLLHUP


def _queue_sync_function() -> Any:
    """libpq 17's `PQsendPipelineSync` from the libpq psycopg loaded (found among the
    process's mappings), or None. It queues a Sync without flushing, which psycopg does not
    expose: a mid-batch Sync would otherwise cost a network write and a server wake-up."""
    try:
        with open("/proc/self/maps") as maps:  # noqa: PTH123 - one read at import
            paths = {line.split()[-1] for line in maps if "libpq" in line.rsplit("/", 1)[-1]}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            function = ctypes.CDLL(path).PQsendPipelineSync
        except (OSError, AttributeError):
            continue
        function.argtypes, function.restype = [ctypes.c_void_p], ctypes.c_int
        return function
    return None


_QUEUE_SYNC = _queue_sync_function()


class Statement:
    __slots__ = ("names", "text")

    def __init__(self, rendered: bytes) -> None:
        names: list[str] = []

        def number(match: re.Match[bytes]) -> bytes:
            if match.group(0) == b"%%":
                return b"%"
            name = match.group(1).decode()
            if name not in names:
                names.append(name)
            return b"$%d" % (names.index(name) + 1)

        self.text = _PLACEHOLDER.sub(number, rendered)
        self.names = tuple(names)


def dump(value: Any, encoding: str) -> bytes | None:
    """A parameter as text: ints and strings as such, int lists as array literals."""
    if type(value) is int:  # the usual parameter (ids, limits, lock keys) first
        return b"%d" % value
    if isinstance(value, str):
        return value.encode(encoding)
    if value is None:
        return None
    if isinstance(value, bool):
        return b"t" if value else b"f"
    if isinstance(value, int):
        return b"%d" % value
    if isinstance(value, list | tuple) and all(type(v) is int for v in value):
        return ("{" + ",".join(map(str, value)) + "}").encode()
    raise TypeError(f"no text form for a {type(value).__name__} parameter")


class Slot:
    """A statement's result, once `sync` read it. Defaults as class attributes: a slot per
    statement, built with no Python `__init__`."""

    result: pq.abc.PGresult | None = None
    tolerated = False
    """Its error is the caller's to read (`error`), not raised by `sync`."""

    @property
    def succeeded(self) -> bool:
        result = self.result
        return result is not None and result.status in _OK

    @property
    def failed(self) -> bool:
        result = self.result
        return result is not None and result.status == pq.ExecStatus.FATAL_ERROR

    def error(self, encoding: str) -> pg_errors.Error | None:
        result = self.result
        if result is None or result.status != pq.ExecStatus.FATAL_ERROR:
            return None
        return pg_errors.error_from_result(result, encoding=encoding)


class Wire:
    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.pg: pq.abc.PGconn = conn.pgconn
        self.encoding: str = conn.info.encoding
        self.tx = Transformer.from_context(conn)
        self._prepared: dict[bytes, tuple[bytes, tuple[str, ...]]] = {}
        self._slots: deque[Slot] = deque()  # statements sent, not yet read
        self._syncs = 0  # Syncs sent, not yet read
        self._sent = 0  # how many of `_slots` went out before the last Sync
        self._active = False
        self._in_block = False  # a BEGIN queued after the last COMMIT or ROLLBACK
        self._unflushed = False  # a Sync queued without a flush
        self._poll = select.poll()
        self._poll.register(self.pg.socket, _POLL_IN)

    # -- statements ---------------------------------------------------------------------

    def prepare(self, rendered: bytes) -> bytes:
        """Prepare `rendered` once on this session (outside the pipeline); returns its name."""
        known = self._prepared.get(rendered)
        if known is not None:
            return known[0]
        self.pause()  # PQprepare is synchronous: not in pipeline mode (first use only)
        statement = Statement(rendered)
        name = b"om_relay_%d" % next(_NAMES)
        result = self.pg.prepare(name, statement.text)
        if result.status != pq.ExecStatus.COMMAND_OK:
            if self.pg.status == pq.ConnStatus.BAD:
                # libpq's made-up result (no SQLSTATE) would be a DatabaseError, not retried.
                message = result.error_message.decode(self.encoding, "replace").strip()
                raise pg_errors.OperationalError(f"connection lost: {message}")
            raise pg_errors.error_from_result(result, encoding=self.encoding)
        self._prepared[rendered] = (name, statement.names)
        return name

    def send(
        self, rendered: bytes, params: dict[str, Any] | None = None, *, tolerate: bool = False
    ) -> Slot:
        """Queue a statement (prepared on first use) in the pipeline.

        `tolerate`: a Sync of its own follows it (queued, not flushed, where libpq allows),
        so its error aborts nothing queued after it and stays in the slot. In a transaction
        block a COMMIT queued next then rolls back: a row that cannot be marked costs its own
        batch's transaction, not the run (relay/batch_loop.py)."""
        known = self._prepared.get(rendered)
        if known is None:
            self.prepare(rendered)
            known = self._prepared[rendered]
        name, names = known
        values = [dump(params[n], self.encoding) for n in names] if names and params else None
        if not self._active:
            self._enter()
        self.pg.send_query_prepared(name, values)
        slot = Slot()
        self._slots.append(slot)
        if tolerate:
            slot.tolerated = True
            if _QUEUE_SYNC is not None:
                if _QUEUE_SYNC(self.pg.pgconn_ptr) != 1:  # type: ignore[attr-defined]
                    raise pg_errors.OperationalError(self.pg.get_error_message(self.encoding))
                self._unflushed = True
            else:
                self.pg.pipeline_sync()  # the statement leaves now, its Sync with it
                self._flush()
            self._syncs += 1
            self._sent = len(self._slots)
        return slot

    def send_plain(self, command: bytes) -> Slot:
        if command == b"BEGIN":
            self._in_block = True
        elif command in _ENDS_BLOCK:
            self._in_block = False
        if not self._active:
            self._enter()
        self.pg.send_query_params(command, None)
        slot = Slot()
        self._slots.append(slot)
        return slot

    def rows(self, slot: Slot) -> list[tuple[Any, ...]]:
        result = slot.result
        if result is None or result.status != pq.ExecStatus.TUPLES_OK:
            return []
        self.tx.set_pgresult(result)
        return self.tx.load_rows(0, result.ntuples, tuple)

    @property
    def ends_transactions(self) -> bool:
        """Whether the session is outside any transaction once the server ran what was sent,
        read or not. libpq says "active" until results are read, so this is what tells a wait
        (relay/waits.py) that it holds no lock."""
        return not self._in_block and self._sent >= len(self._slots) and not self._unflushed

    # -- the round trip -------------------------------------------------------------------

    def send_sync(self) -> None:
        """Send a Sync with everything queued, not waiting: the next `sync` reads these
        results with its own, one wake-up instead of two."""
        if self._slots and self._sent < len(self._slots):
            self.pg.pipeline_sync()
            self._flush()
            self._syncs += 1
            self._sent = len(self._slots)
        elif self._unflushed:
            self._flush()
        self._unflushed = False

    def sync(self) -> None:
        """Send a Sync with everything queued, read every result; raise the first error (the
        caller rolls the aborted transaction back, as with psycopg's pipeline)."""
        self.send_sync()
        if not self._syncs:
            return
        error: pq.abc.PGresult | None = None
        slots, pg = self._slots, self.pg
        while self._syncs:
            while pg.is_busy():  # read inline, not through a call: this runs per result
                self._wait_readable()
                pg.consume_input()
            result = pg.get_result()
            if result is None:
                self._check_alive()
                continue
            status = result.status
            if status == _SYNCED:
                self._syncs -= 1
                continue
            # One result per statement (or "aborted"), then the None that ends its results:
            # libpq has it without reading more.
            if pg.get_result() is not None:
                raise pg_errors.InterfaceError("the relay sent a statement with two results")
            slot = slots.popleft() if slots else None
            tolerated = False
            if slot is not None:
                slot.result, tolerated = result, slot.tolerated
            if status == _FAILED and error is None and not tolerated:
                error = result
        slots.clear()
        self._sent = 0
        if error is not None:
            raise pg_errors.error_from_result(error, encoding=self.encoding)

    def _check_alive(self) -> None:
        pg = self.pg
        if pg.status == pq.ConnStatus.BAD:
            # A Sync never to be answered: a second read (cleanup) would spin for ever.
            message = pg.get_error_message(self.encoding) or "the server closed the session"
            raise pg_errors.OperationalError(f"connection lost: {message.strip()}")

    def _wait_readable(self) -> None:
        while not self._poll.poll(1000):
            pass

    def _flush(self) -> None:
        pg = self.pg
        while pg.flush() == 1:  # the socket's buffer is full: wait until it drains
            select.select([], [pg.socket], [], 1.0)

    # -- pipeline mode ----------------------------------------------------------------------

    @contextmanager
    def pipeline(self) -> Iterator[Wire]:
        """A run of batches: on exit what is queued is read; on an exception pipeline mode is
        left so the caller can roll back with ordinary statements."""
        try:
            yield self
            self.sync()
        except BaseException:
            self.close()
            raise
        self._leave()

    def pause(self) -> None:
        """Read everything queued and leave pipeline mode, the transaction open, for ordinary
        `conn.execute` calls; the next `send` enters again."""
        self.sync()
        self._leave()

    def close(self) -> None:
        """After a failure: drain what can be drained, leave pipeline mode (best effort)."""
        try:
            if (self._slots or self._syncs) and self.pg.status == pq.ConnStatus.OK:
                self.sync()
        except pg_errors.Error:  # the error that got us here is the one that counts
            log.debug("relay.wire_drain_failed", exc_info=True)
        self._slots.clear()
        self._syncs = self._sent = 0
        try:
            self._leave()
        except pg_errors.Error:  # a broken session: the caller replaces it
            self._active = False

    def _enter(self) -> None:
        if not self._active:
            self.pg.enter_pipeline_mode()
            self._active = True

    def _leave(self) -> None:
        if self._active:
            self._slots.clear()
            self.pg.exit_pipeline_mode()
            self._active = False


def direct(conn: Any, wire: Wire) -> Any:
    """`conn` for ordinary statements in the batch's transaction, the pipeline paused first."""
    return _Direct(conn, wire)


class _Direct:
    __slots__ = ("_conn", "_wire")

    def __init__(self, conn: Any, wire: Wire) -> None:
        self._conn, self._wire = conn, wire

    def execute(self, query: Any, params: Sequence[Any] | dict[str, Any] | None = None) -> Any:
        self._wire.pause()
        return self._conn.execute(query, params)
