"""The schema zoo: outbox tables as teams actually have them, and a rolling deploy of each
through HOPER or HOPIA under live writers and relays.

Each `ZooTable` is a DDL script, the column roles that name its columns (`OutboxSpec`
settings), an INSERT the application would run (parameter `n`, a sequence number that also
ends up in the payload and in one broker header), and that header. `migrate_under_load`
plays the deploys like an operator: run a phase's steps, roll the new version out while the
old one still runs, retire the old one, and so on to the end (HOPER, HOPIA, or HOP, which
ends at V3), then checks that every row ever written was delivered, with its header, and
that the runner's invariants hold.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from outbox_migrate.config import OutboxSpec, Settings, load_settings
from outbox_migrate.errors import PreconditionFailed
from outbox_migrate.patterns import build_pattern, marker, marker_catalog
from outbox_migrate.relay.message import Message
from outbox_migrate.relay.options import Mode, RelayOptions, SwitchGate
from outbox_migrate.relay.sinks import Sink
from outbox_migrate.relay.worker import Relay
from outbox_migrate.runner import Runner

APP = "zoo-app"
WRITE_PAUSE_S = 0.004
GATE_PATIENCE_S = 60.0
DRAIN_TIMEOUT_S = 60.0
SEEDED_PUBLISHED = 40
SEEDED_UNPUBLISHED = 25


@dataclass(frozen=True)
class ZooTable:
    name: str
    ddl: str
    settings: dict[str, Any]
    insert: str
    """INSERT into `{table}` (a psycopg.sql placeholder) with parameter %(n)s, RETURNING the id."""
    header: tuple[str, str]
    """(header name, value with `{n}`) every message of row n must carry."""
    after_v2: Callable[[psycopg.Connection[Any], Settings], None] | None = None
    """Extra checks once V2's steps ran (e.g. a copied CHECK refuses a bad row)."""
    include_optional: bool = False
    """Run the optional steps too (disable-old-triggers, set-not-null, final drops)."""
    after_seed: Callable[[psycopg.Connection[Any]], None] | None = None
    """Runs (autocommit) once the table is created and seeded, before any writer starts: e.g.
    a CDC consumer's publication and slot."""
    original_name: bool = False
    """Go on through the optional original-name phases: the rename with the previous version
    writing through the view and its relay marking through it, the next version on the
    original name, then the view's drop (needs `include_optional`)."""
    roll_back_rename: bool = False
    """With `original_name`: roll the rename back and apply it again while the previous
    version writes and publishes, before the next version starts."""

    def spec_settings(self, **extra: Any) -> Settings:
        values = {"gate_window_s": 0.2, "lock_budget_s": 30.0, "old_app_name": f"{APP}/V1/%"}
        return load_settings({**values, **self.settings, **extra}, environ={})


class Collector:
    """A real sink that keeps what it is given (thread-safe); shared by every relay."""

    name = "zoo"

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.messages: list[Message] = []

    def factory(self) -> Callable[[], Sink]:
        owner = self

        class _Sink:
            name = "zoo"

            def publish(self, batch: Sequence[Message]) -> None:
                with owner.lock:
                    owner.messages.extend(batch)

            def close(self) -> None:
                return None

        return lambda: _Sink()  # type: ignore[return-value]


@dataclass
class Writer:
    """One application instance inserting into one table, as fast as WRITE_PAUSE_S allows."""

    dsn: str
    table: sql.Composed
    insert: str
    version: str
    counter: Callable[[], int]
    written: list[Any] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> Writer:
        self.thread = threading.Thread(target=self._run, name=f"writer-{self.version}", daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        statement = sql.SQL(self.insert).format(table=self.table)  # type: ignore[arg-type]
        with psycopg.connect(
            self.dsn, autocommit=True, application_name=f"{APP}/{self.version}/writer"
        ) as conn:
            while not self.stop.is_set():
                try:
                    row = conn.execute(statement, {"n": self.counter()}).fetchone()
                    assert row is not None
                    self.written.append(row[0])
                except psycopg.Error as exc:
                    self.errors.append(str(exc).splitlines()[0])
                    time.sleep(0.05)
                time.sleep(WRITE_PAUSE_S)

    def finish(self) -> None:
        self.stop.set()
        assert self.thread is not None
        self.thread.join(timeout=30)

    def stop_quietly(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=10)


class RelayThread:
    def __init__(self, dsn: str, settings: Settings, sink: Callable[[], Sink], mode: Mode,
                 version: str) -> None:  # fmt: skip
        self.relay = Relay(
            dsn,
            sink,
            spec=settings.spec,
            options=RelayOptions(
                mode=mode,
                batch_size=50,
                poll_interval_s=0.05,
                switch_gate=SwitchGate.sessions,
                old_app_name=f"{APP}/V1/%",
            ),
            application_name=f"{APP}/{version}/relay",
        )
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"relay-{version}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.relay.run()
        except BaseException as exc:  # reported by finish()
            self.error = exc

    def finish(self) -> None:
        self.relay.stop()
        self.thread.join(timeout=30)
        assert self.error is None, self.error

    def stop_quietly(self) -> None:
        self.relay.stop()
        self.thread.join(timeout=10)


def run_phase(
    dsn: str, settings: Settings, pattern: str, phase: str, include_optional: bool = False
) -> None:
    """Run a phase's steps like an operator: while a deploy gate says the previous rollout is
    not finished, wait and try again."""
    deadline = time.monotonic() + GATE_PATIENCE_S
    while True:
        try:
            with Runner(dsn, settings, pattern, include_optional=include_optional) as runner:
                runner.run(phase)
            return
        except PreconditionFailed as exc:
            print("zoo.retry", phase, exc)
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def _seed(conn: psycopg.Connection[Any], zoo: ZooTable, table: sql.Composed,
          counter: Callable[[], int]) -> list[Any]:  # fmt: skip
    statement = sql.SQL(zoo.insert).format(table=table)  # type: ignore[arg-type]
    ids = []
    for _ in range(SEEDED_PUBLISHED + SEEDED_UNPUBLISHED):
        row = conn.execute(statement, {"n": counter()}).fetchone()
        assert row is not None
        ids.append(row[0])
    return ids


@dataclass
class Outcome:
    written: list[Any]
    delivered: list[Message]
    writer_errors: list[str]
    final_rows: int
    unpublished_left: int
    violations: list[str]


def _choreograph(dsn: str, zoo: ZooTable, pattern: str, settings: Settings,
                 factory: Callable[[], Sink], counter: Callable[[], int],
                 writers: list[Writer], relays: list[RelayThread],
                 resolved: OutboxSpec) -> tuple[Any, list[str]]:  # fmt: skip
    spec = resolved
    old = sql.Identifier(spec.schema, spec.table)
    new = sql.Identifier(spec.schema, spec.partitioned_table)

    def writer(table: sql.Identifier, version: str) -> Writer:
        started = Writer(dsn, table, zoo.insert, version, counter).start()  # type: ignore[arg-type]
        writers.append(started)
        return started

    def relay(mode: Mode, version: str) -> RelayThread:
        started = RelayThread(dsn, settings, factory, mode, version)
        relays.append(started)
        return started

    v1_writer = writer(old, "V1")
    v1_relay = relay(Mode.flat, "V1")
    time.sleep(0.5)

    run_phase(dsn, settings, pattern, "V2", zoo.include_optional)
    if zoo.after_v2 is not None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            zoo.after_v2(conn, settings)
    v2_writer = writer(new, "V2")
    v2_relay = relay(Mode.switching, "V2")
    time.sleep(0.5)  # V1 and V2 side by side
    v1_writer.finish()
    time.sleep(0.3)
    v1_relay.finish()

    run_phase(dsn, settings, pattern, "V3", zoo.include_optional)
    v3_relay = relay(Mode.partitioned, "V3")
    time.sleep(0.3)
    v2_relay.finish()

    if "V4" in build_pattern(pattern).phase_names():  # HOP and COP end at V3
        run_phase(dsn, settings, pattern, "V4", zoo.include_optional)
        time.sleep(0.3)
    if pattern == "hoper":
        run_phase(dsn, settings, pattern, "copy-back", zoo.include_optional)
    if zoo.original_name:
        # The previous version (V2's writer, V3's relay, both on the former name) runs on
        # across the rename; the next one uses the original name; then the view goes.
        run_phase(dsn, settings, pattern, "original-name", zoo.include_optional)
        if zoo.roll_back_rename:
            time.sleep(0.3)
            with Runner(dsn, settings, pattern, include_optional=True) as runner:
                runner.rollback("copy-back" if pattern == "hoper" else "V4")
            time.sleep(0.3)
            run_phase(dsn, settings, pattern, "original-name", zoo.include_optional)
        through_view = len(v2_writer.written)
        # The relay of the next version names the partitioned table by its original name;
        # `table` (the flat table, unused in partitioned mode) must be some other name.
        renamed = zoo.spec_settings(partitioned_table=spec.table, table=spec.retired_table)
        next_writer = writer(old, "V5")
        next_relay = RelayThread(dsn, renamed, factory, Mode.partitioned, "V5")
        relays.append(next_relay)
        time.sleep(0.5)  # both versions side by side on both names
        v2_writer.finish()
        # The previous version really wrote through the view (its INSERTs did not fail).
        assert len(v2_writer.written) > through_view, "no insert through the view"
        v3_relay.finish()
        run_phase(dsn, settings, pattern, "drop-view", zoo.include_optional)
        time.sleep(0.3)
        next_writer.finish()
        v3_relay, new = next_relay, old
    else:
        v2_writer.finish()

    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    with psycopg.connect(dsn, autocommit=True) as conn:
        while True:
            row = conn.execute(
                sql.SQL("SELECT count(*) FILTER (WHERE {p}), count(*) FROM {t}").format(
                    p=marker.unpublished(spec), t=new
                )
            ).fetchone()
            assert row is not None
            if row[0] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    v3_relay.finish()
    with Runner(dsn, settings, pattern, include_optional=zoo.include_optional) as runner:
        violations = runner.verify()
    return row, violations


def migrate_under_load(
    dsn: str, zoo: ZooTable, pattern: str, sink: Callable[[], Sink] | None = None
) -> tuple[Outcome, Collector]:
    """V1 → the pattern's end with writers and relays of each version running across every
    deploy; returns what was written and what the sink received."""
    settings = zoo.spec_settings()
    spec = settings.spec
    old = sql.Identifier(spec.schema, spec.table)
    lock = threading.Lock()
    sequence = iter(range(1, 10**9))

    def counter() -> int:
        with lock:
            return next(sequence)

    collector = Collector()
    factory = sink or collector.factory()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(zoo.ddl)
        # a flag marker's values (its DEFAULT) for the harness's own SQL; the runner and the
        # relays resolve them by themselves
        resolved = marker_catalog.resolve(conn, spec)
        seeded = _seed(conn, zoo, old, counter)
        # the first rows are "already published" by V1's relay before the story starts
        conn.execute(
            sql.SQL("UPDATE {t} SET {p} WHERE {i} = ANY(%s)").format(
                t=old, p=marker.mark(resolved), i=sql.Identifier(spec.id_column)
            ),
            (seeded[:SEEDED_PUBLISHED],),
        )
        if zoo.after_seed is not None:
            zoo.after_seed(conn)
    written = list(seeded[SEEDED_PUBLISHED:])
    writers: list[Writer] = []
    relays: list[RelayThread] = []
    try:
        row, violations = _choreograph(dsn, zoo, pattern, settings, factory, counter, writers,
                                       relays, resolved)  # fmt: skip
    finally:
        for actor in [*writers, *relays]:
            actor.stop_quietly()
    for writer in writers:
        written.extend(writer.written)
    with collector.lock:
        delivered = list(collector.messages)
    outcome = Outcome(
        written=written,
        delivered=delivered,
        writer_errors=[e for w in writers for e in w.errors],
        final_rows=int(row[1]),
        unpublished_left=int(row[0]),
        violations=violations,
    )
    return outcome, collector


def check_delivery(outcome: Outcome, zoo: ZooTable) -> None:
    """Lost 0, every message with its header, no writer error, every row kept and published."""
    assert outcome.writer_errors == [], outcome.writer_errors[:3]
    assert outcome.violations == []
    assert outcome.unpublished_left == 0
    delivered_ids = {str(m.id) for m in outcome.delivered}
    lost = [i for i in outcome.written if str(i) not in delivered_ids]
    assert lost == [], f"{len(lost)} lost, e.g. {lost[:5]}"
    assert outcome.final_rows == SEEDED_PUBLISHED + len(outcome.written)
    name, template = zoo.header
    for message in outcome.delivered:
        n = json.loads(message.payload)["n"]
        assert message.headers().get(name) == template.format(n=n), (message, name)
