"""The polling relay's lifecycle: start, stop, the workers' threads, the shutdown timeout, the
metrics sampler. A worker is relay/driver.py.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from outbox_migrate.config import OutboxSpec
from outbox_migrate.db import APPLICATION_NAME, one_line
from outbox_migrate.errors import NamesMoved, RelayFailed
from outbox_migrate.patterns import notify
from outbox_migrate.relay import library_logs, marker_source, queries
from outbox_migrate.relay.bad_rows import FailedMessages
from outbox_migrate.relay.driver import Worker
from outbox_migrate.relay.message import Message, TextIdMessage
from outbox_migrate.relay.metrics import Observer, start_sampler
from outbox_migrate.relay.options import Mode, Ordering, RelayOptions
from outbox_migrate.relay.refusals import Refusals
from outbox_migrate.relay.run_stats import RelayStats
from outbox_migrate.relay.shared import Shared, close_sink, connection_errors
from outbox_migrate.relay.sinks import SinkFactory
from outbox_migrate.relay.switching import SourceState

log = logging.getLogger("outbox_migrate.relay")

RELAY_APPLICATION_NAME = f"{APPLICATION_NAME} relay"
ABANDON_GRACE_S = 2.0
"""After the shutdown timeout: how long abandoned workers get to roll back and exit."""

__all__ = ["RELAY_APPLICATION_NAME", "Relay", "RelayStats", "running"]


class Relay:
    """Publishes an outbox (flat, partitioned, or switching between them) through a sink."""

    def __init__(
        self,
        dsn: str,
        sink_factory: SinkFactory,
        *,
        spec: OutboxSpec | None = None,
        options: RelayOptions | None = None,
        observer: Observer | None = None,
        application_name: str = RELAY_APPLICATION_NAME,
        freeze_gc: bool = False,
    ) -> None:
        """`freeze_gc`: the process is the relay's own (the CLI's): once started, everything
        made so far (modules, the sink's client, the catalog facts) leaves the cyclic
        collector's reach, so its full collections walk only what the relay allocates while
        it runs (bench/README.md, "Builds at the same time")."""
        self.dsn = dsn
        self.freeze_gc = freeze_gc
        self.spec = spec or OutboxSpec()
        self.options = options = options or RelayOptions()
        self.sink_factory = sink_factory
        self.observer = observer or Observer()
        self.application_name = application_name
        self.state = SourceState(self.spec, options.mode, options.switch_gate, options.old_app_name)
        self.stats = RelayStats()
        self._stop = threading.Event()
        self._wake_fds: tuple[int, int] | None = None
        self._wake_lock = threading.RLock()
        """Re-entrant: a signal handler may call `stop` on the thread that holds it."""
        text_ids = self.spec.id_kind == "application"
        self.failures = FailedMessages(
            self.spec.schema, options.dead_letter_table, options.attempts_table,
            options.max_attempts, text_ids,
        )  # fmt: skip
        self.shared = Shared(
            dsn=dsn, application_name=application_name, options=options, state=self.state,
            stats=self.stats, observer=self.observer, sink_factory=sink_factory,
            refusals=Refusals(self.failures, self.stats, self.observer, options.backoff,
                              by_key=options.ordering is Ordering.key),
            text_ids=text_ids, message=TextIdMessage if text_ids else Message,
            stopped=self._stop, request_stop=self.stop, wake_fd=self.wake_fd,
        )  # fmt: skip

    # -- lifecycle -------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask every worker to finish its in-flight batch and exit (thread- and signal-safe)."""
        self._stop.set()
        with self._wake_lock:
            fds = self._wake_fds
            if fds is not None:
                with contextlib.suppress(OSError):  # full: a byte is there already
                    os.write(fds[1], b"x")

    def run(self) -> RelayStats:
        """Run the workers until `stop()` (or, with `until_empty`, until nothing is left)."""
        library_logs.route()
        # One sink built and closed first: a configuration error is a `RelayError` at start
        # (exit 2), not a worker failure or an "outage" retried for ever later.
        close_sink(self.sink_factory())
        self._prepare()
        if self.freeze_gc:
            gc.collect()  # start-up's garbage first: frozen, it would never go
            gc.freeze()
        options = self.options
        log.info(
            "relay.started mode=%s workers=%d shards=%d batch=%d",
            options.mode, options.workers, options.shard_count, options.batch_size,
        )  # fmt: skip
        threads = [
            threading.Thread(target=self._worker, args=(i,), name=f"relay-{i}", daemon=True)
            for i in range(options.workers)
        ]
        read, write = os.pipe()
        os.set_blocking(write, False)
        self._wake_fds = (read, write)
        for thread in threads:
            thread.start()
        sampler = start_sampler(self.observer, self._stop, self._connect, self._sample,
                                "relay-sample")  # fmt: skip
        names = _NamesWatch(self._connect)
        try:
            while any(t.is_alive() for t in threads) and not self._stop.is_set():
                for thread in threads:
                    thread.join(timeout=0.2)
                names.look(self.state.current, self.shared)
        finally:
            self.stop()
            self._shutdown(threads)
            if sampler is not None:
                sampler.join(timeout=2.0)
            self._close_wake_pipe()
        self.stats.switches = self.state.switches
        fatal = self.shared.fatal
        if fatal is not None:
            # A fault while running is a failure (exit 1), not bad input (exit 2).
            if isinstance(fatal, RelayFailed):
                raise fatal
            raise RelayFailed(f"relay worker failed: {one_line(str(fatal))}") from fatal
        log.info("relay.stopped %s", " ".join(f"{k}={v}" for k, v in self.stats.as_dict().items()))
        return self.stats

    def _close_wake_pipe(self) -> None:
        with self._wake_lock:
            fds, self._wake_fds = self._wake_fds, None
            if fds is not None:
                for fd in fds:
                    os.close(fd)

    def wake_fd(self) -> int | None:
        fds = self._wake_fds
        return None if fds is None else fds[0]

    def _shutdown(self, threads: list[threading.Thread]) -> None:
        deadline = time.monotonic() + self.options.shutdown_timeout_s
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        late = [t for t in threads if t.is_alive()]
        if not late:
            return
        # Abandon the in-flight batch before its mark: a running query is cancelled, a worker
        # waiting on the broker rolls back when the call returns.
        self.shared.abandon.set()
        self.stats.add(abandoned_workers=len(late))
        log.warning("relay.shutdown_timeout workers=%d", len(late))
        for conn in list(self.shared.conns.values()):
            try:
                conn.cancel_safe(timeout=1.0)
            except Exception:  # best effort: the connection is in use elsewhere
                log.debug("relay.cancel_failed", exc_info=True)
        for thread in late:
            thread.join(timeout=ABANDON_GRACE_S)

    def _prepare(self) -> None:
        with self._connect() as conn:
            self.spec, self.state = marker_source.resolved(conn, self.spec, self.state)
            self.shared.state = self.state  # what the workers see (relay/shared.py)
            sources = [self.state.current]
            if self.options.mode is Mode.switching:
                sources = [self.state.flat, self.state.partitioned]
            options = self.options
            for source in sources:
                marker_source.check_markable(conn, source)
                self.shared.columns[source.label] = marker_source.resolve_columns(conn, source,
                    self.spec, options.key_column, options.event_type_column,
                    options.ordering)  # fmt: skip
            self.failures.prepare(conn, [source.label for source in sources])
            if self.options.listen and self.options.mode is not Mode.flat:
                self._check_trigger_key(conn)

    def _check_trigger_key(self, conn: Any) -> None:
        """A wake-up trigger installed under the table's old name uses another idle lock key:
        it would never see this relay idle, so plain INSERTs would wait for the poll."""
        if notify.key_matches(conn, self.spec) is False:
            log.warning(
                "relay.notify_trigger_stale table=%s: the wake-up trigger was installed for "
                "another table name (renamed since?); reinstall it with relay --install-notify",
                notify.label(self.spec),
            )

    def _worker(self, index: int) -> None:
        Worker(self.shared, index).run()

    # -- helpers threads ------------------------------------------------------------------

    def _connect(self) -> Any:
        from outbox_migrate.db import connect

        return connect(self.dsn, application_name=self.application_name)

    def _sample(self, conn: Any) -> None:
        source = self.state.current
        row = conn.execute(queries.backlog(source, self.shared.columns[source.label])).fetchone()
        if row:
            self.observer.backlog(int(row[0]), float(row[1]))


class _NamesWatch:
    """A look at the relay's names every NAMES_CHECK_S on a short session of its own, off the
    workers' runs: a claim relation renamed away would leave the workers idle for ever."""

    def __init__(self, connect: Callable[[], Any]) -> None:
        self.connect = connect
        self.due = time.monotonic() + marker_source.NAMES_CHECK_S

    def look(self, source: queries.Source, shared: Shared) -> None:
        from outbox_migrate.errors import ConnectError

        now = time.monotonic()
        if now < self.due:
            return
        self.due = now + marker_source.NAMES_CHECK_S
        try:
            with self.connect() as conn:
                marker_source.check_names(conn, source)
        except NamesMoved as exc:
            shared.fail(exc)
        except connection_errors(ConnectError):  # looked at again next time
            log.debug("relay.names_unchecked", exc_info=True)


@contextmanager
def running(relay: Relay) -> Iterator[threading.Thread]:
    """Run a relay in a background thread for the duration of a `with` block (tests, sim)."""
    thread = threading.Thread(target=relay.run, name="relay", daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        relay.stop()
        thread.join(timeout=relay.options.shutdown_timeout_s + ABANDON_GRACE_S + 5)
