"""The operator fuzzer's world: the CLI run in-process, and the application it migrates.

The fuzzer (tests/integration/runner/test_operator_fuzzer.py) plays an operator who types
`run`, `next`, `rollback`, `reset`, `copy-back`, `verify` and `status` in any order, while the
application keeps writing and publishing. This module holds what that needs and nothing
about the rules themselves:

* `cli` runs `outbox_migrate.cli.app.main` in this process (a subprocess costs ~1 s of
  imports per command; in-process gives the same exit code and stderr in milliseconds);
* `App` is one deployed application version: a writer thread inserting into the table that
  version inserts into, and a real `Relay` (the simulator's `relay_main`, in a thread) in
  that version's mode, publishing into the recording sink. Their `application_name`s are the
  simulator's (`demo-app/V1/writer-0`), so the deploy gates see them as real instances;
* `Outbox` is the shape of the sequence's outbox (marker, ids, a headers column for bad rows,
  the CDC relay): its table, its settings file, the application's INSERT;
* `outbox_keys` / `published_keys` / `dead_lettered_keys` read what the database holds, what
  was delivered and what was dead-lettered.

Every key the writer got a successful COMMIT for is recorded: those are the messages that
must never be lost.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import psycopg
from hypothesis import strategies as st
from outbox_migrate_harness.sim import recording
from outbox_migrate_harness.sim.actors import relay_options
from outbox_migrate_harness.sim.scenario import APP_NAME_PREFIX, app_name, relay_mode
from psycopg import sql

from outbox_migrate.config import OutboxSpec, load_settings
from outbox_migrate.patterns.model import Phase, Table
from outbox_migrate.relay.options import CdcOptions, Mode

DOCUMENTED_EXIT_CODES = frozenset({0, 1, 2, 3, 4, 5, 6})
"""docs/cli.md's codes a command may end with here (130/143 need a signal, none is sent)."""
OLD_APP_PATTERN = f"{APP_NAME_PREFIX}/V1/%"
WRITER_RATE_PER_S = 40.0
MAX_HOLD_S = 0.15
"""Longest a writer's transaction stays open after its INSERT."""
RELAY_BATCH = 50
RELAY_RESTART_PAUSE_S = 0.5


MARKERS = ("timestamp", "smallint", "boolean")
"""The publication marker: `published_at timestamptz` (NULL = unpublished), or a flag
`published` (0/1, false/true) that the migration partitions on instead."""
ID_KINDS = ("database", "bigint", "uuid")
"""The id: an identity (`id_kind = database`), or one the application supplies
(`id_kind = application`): a snowflake-like bigint, or a random uuid claimed in
`created_at` order (`order_column`)."""
BAD_HEADERS = "[1]"
"""A headers value that is not a JSON object: a bad row the relay dead-letters
(docs/relay.md, bad rows)."""
_app_ids = itertools.count(10**15)
"""Application bigint ids, increasing across versions and sequences (snowflake-like)."""


@dataclass(frozen=True)
class Outbox:
    """The shape of one sequence's outbox and how its relays publish it.

    Drawn whole when a sequence begins, so a replay of the same draws builds the same
    outbox: nothing here depends on what the sequence later meets."""

    marker: str = "timestamp"
    ids: str = "database"
    headers: bool = False
    """A `headers jsonb` column, so the sequence can insert bad rows."""
    cdc: bool = False
    """The versions that publish from the partitioned table run the CDC relay."""

    def describe(self) -> str:
        parts = [] if self.marker == "timestamp" else [f"marker {self.marker}"]
        parts += [] if self.ids == "database" else [f"ids {self.ids}"]
        parts += ["headers (bad rows)"] if self.headers else []
        parts += ["cdc relay"] if self.cdc else []
        return ", ".join(parts) or "default outbox"

    @property
    def published_column(self) -> str:
        return "published_at" if self.marker == "timestamp" else "published"

    def config(self) -> dict[str, str]:
        """outbox-migrate.toml's keys for this outbox (none for the spec's default)."""
        found: dict[str, str] = {}
        if self.marker != "timestamp":
            found["published_column"] = "published"
            found["unpublished_value"] = "0" if self.marker == "smallint" else "false"
            found["published_value"] = "1" if self.marker == "smallint" else "true"
        if self.ids != "database":
            found["id_kind"] = "application"
            # The id alone cannot stay unique on the partitioned table (its key must include
            # the marker); `plan` refuses until the operator accepts that, as one would.
            found["accept_lost_unique"] = "outbox_pkey"
        if self.ids == "uuid":
            found["order_column"] = "created_at"
        return found

    def write_config(self, directory: str) -> None:
        """The settings file every command reads (in-process and subprocess: same cwd)."""
        path = os.path.join(directory, "outbox-migrate.toml")
        config = self.config()
        if not config:
            if os.path.exists(path):
                os.remove(path)
            return
        with open(path, "w", encoding="utf-8") as handle:
            handle.writelines(f'{key} = "{value}"\n' for key, value in config.items())

    def spec(self) -> OutboxSpec:
        environ = {f"OUTBOX_MIGRATE_{k.upper()}": v for k, v in self.config().items()}
        return load_settings({}, environ=environ, cwd=_NO_CONFIG).spec

    def create(self, conn: psycopg.Connection[Any]) -> None:
        """The flat outbox of this shape, with a partial index on its unpublished rows."""
        id_column = {
            "database": "id bigint GENERATED ALWAYS AS IDENTITY",
            "bigint": "id bigint",
            "uuid": "id uuid",
        }[self.ids]
        marker = {
            "timestamp": "published_at timestamptz",
            "smallint": "published smallint NOT NULL DEFAULT 0",
            "boolean": "published boolean NOT NULL DEFAULT false",
        }[self.marker]
        headers = ", headers jsonb" if self.headers else ""
        conn.execute(
            f"CREATE TABLE outbox ({id_column}, event_type text NOT NULL DEFAULT 'event', "
            f"message_key text, payload json NOT NULL, "
            f"created_at timestamptz NOT NULL DEFAULT now(), {marker}{headers}, PRIMARY KEY (id))"
        )
        conn.execute(
            f"CREATE INDEX outbox_unpublished_id_idx ON outbox (id) WHERE {self.unpublished()}"
        )

    def unpublished(self) -> str:
        return {
            "timestamp": "published_at IS NULL",
            "smallint": "published = 0",
            "boolean": "NOT published",
        }[self.marker]

    def seed(
        self, conn: psycopg.Connection[Any], key: str, published: bool, bad: bool = False
    ) -> None:
        """One row there before the migration; `bad`: its headers are not a JSON object."""
        value = {"timestamp": "now()", "smallint": "1", "boolean": "true"}[self.marker]
        columns = ["message_key", "payload"] + ([self.published_column] if published else [])
        values = ["%(key)s", "'{}'"] + ([value] if published else [])
        if self.ids != "database":
            columns.append("id")
            values.append("%(id)s")
        if bad:
            columns.append("headers")
            values.append("%(headers)s::jsonb")
        conn.execute(
            f"INSERT INTO outbox ({', '.join(columns)}) VALUES ({', '.join(values)})",
            {"key": key, "id": self.new_id(), "headers": BAD_HEADERS},
        )

    def new_id(self) -> int | uuid.UUID | None:
        if self.ids == "bigint":
            return next(_app_ids)
        if self.ids == "uuid":
            return uuid.uuid4()
        return None

    def insert(self, table: str) -> sql.Composed:
        """The application's INSERT into `table`: params `key`, `id`, `headers`."""
        columns = ["event_type", "message_key", "payload"]
        values = ["'demo'", "%(key)s", "'{{}}'"]
        if self.ids != "database":
            columns.append("id")
            values.append("%(id)s")
        if self.headers:
            columns.append("headers")
            values.append("%(headers)s::jsonb")
        return sql.SQL(
            "INSERT INTO {} (" + ", ".join(columns) + ") VALUES (" + ", ".join(values) + ")"
        ).format(sql.Identifier(table))

    def params(self, key: str, bad: bool = False) -> dict[str, Any]:
        return {"key": key, "id": self.new_id(), "headers": BAD_HEADERS if bad else None}


DEFAULT_OUTBOX = Outbox()


def _outbox(marker: str, ids_relay: tuple[str, bool], headers: bool) -> Outbox:
    ids, cdc = ids_relay
    return Outbox(marker, ids, headers, cdc)


IDS_AND_RELAY = (("database", False), ("database", True), ("bigint", False), ("uuid", False))
"""The CDC relay takes database-generated bigint ids only (relay/cdc/relay.py): the id kind
and the relay are one draw, each of the four a quarter of the sequences."""
OUTBOXES = st.builds(
    _outbox,
    marker=st.sampled_from(MARKERS),
    ids_relay=st.sampled_from(IDS_AND_RELAY),
    headers=st.booleans(),
)
"""Every outbox shape a sequence may draw; the spec's default (timestamp, identity, no
headers, polling relay) is where a failing one shrinks to."""


def outbox_kinds(optional: bool, outbox: Outbox) -> list[str]:
    """The kinds a sequence exercises, as counted in the run's summary and `event`s."""
    return [
        "rename phases" if optional else "no rename",
        f"marker {outbox.marker}",
        f"ids {outbox.ids}",
        "bad rows" if outbox.headers else "no bad rows",
        "cdc relay" if outbox.cdc else "polling relay",
    ]


_NO_CONFIG = __import__("pathlib").Path("/nonexistent-outbox-migrate-config")


@dataclass(frozen=True)
class CliResult:
    argv: tuple[str, ...]
    code: int
    stdout: str
    stderr: str
    elapsed_s: float

    def line(self, dsn: str = "") -> str:
        """The command (without `--dsn DSN`) and its outcome in one line, for the log."""
        last = self.stderr.strip().splitlines()[-1] if self.stderr.strip() else ""
        argv = " ".join(self.argv).replace(f" --dsn {dsn}", "") if dsn else " ".join(self.argv)
        return f"{argv} -> {self.code} {last}".rstrip()


_cli_lock = threading.Lock()


def cli(*argv: str) -> CliResult:
    """`outbox-migrate ARGV` in this process: exit code, stdout, stderr.

    `main` always ends in `sys.exit`; the streams are swapped for the call (nothing else in
    this process prints: the actors report through data, the relay logs through `logging`).
    """
    from outbox_migrate.cli.app import main

    out, err = io.StringIO(), io.StringIO()
    started = time.monotonic()
    code: int
    with _cli_lock, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(argv))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        else:  # pragma: no cover - main() always exits
            code = 0
    return CliResult(tuple(argv), code, out.getvalue(), err.getvalue(), time.monotonic() - started)


def cli_processes(*commands: tuple[str, ...], env: dict[str, str]) -> list[CliResult]:
    """Several `outbox-migrate` commands as subprocesses started together: two operators
    typing at the same moment (the in-process `cli` cannot overlap with itself)."""
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "outbox_migrate", *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**scrubbed_environment(), **env},
        )
        for argv in commands
    ]
    results: list[CliResult] = []
    for argv, proc in zip(commands, procs, strict=True):
        out, err = proc.communicate(timeout=120)
        results.append(CliResult(argv, proc.returncode, out, err, time.monotonic() - started))
    return results


def cli_signalled(
    argv: tuple[str, ...], env: dict[str, str], signum: int, after_s: float
) -> CliResult:
    """`outbox-migrate ARGV` as a subprocess that receives `signum` after `after_s` (an
    operator's Ctrl-C, a deploy tool's SIGTERM, an OOM kill), if it is still running."""
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "outbox_migrate", *argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**scrubbed_environment(), **env},
    )
    try:
        out, err = proc.communicate(timeout=after_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=120)
    return CliResult(argv, proc.returncode, out, err, time.monotonic() - started)


def scrubbed_environment() -> dict[str, str]:
    """This process's environment without our or libpq's variables (as tests/support/cli.py
    does), so only what the fuzzer sets reaches the subprocess."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_MIGRATE_", "PG"))}


RENAMED_SPEC = OutboxSpec(table="outbox_retired", partitioned_table="outbox")
"""How a version of the original name configures its relay (docs/relay.md)."""


def table_for(phase: Phase) -> str:
    """The table `phase`'s version inserts into: a version of the original name (the optional
    rename phases) inserts into `outbox`, the partitioned table's new name."""
    if phase.app.inserts_into is Table.OLD or phase.app.renamed:
        return "outbox"
    return "outbox_new"


class Writer:
    """One writer instance of an application version: one INSERT per transaction.

    Half of the transactions stay open a little after their INSERT (as an application's do
    while it finishes its own work), so the runner's DDL really meets a writer holding the
    table's lock with an uncommitted row — the race a precondition checked before the lock
    loses.
    """

    def __init__(
        self, dsn: str, phase: Phase, committed: list[str], seed: int = 0,
        outbox: Outbox = DEFAULT_OUTBOX,
    ) -> None:  # fmt: skip
        self.dsn = dsn
        self.outbox = outbox
        self.version = phase.name
        self.table = table_for(phase)
        self.committed = committed
        self.failed = 0
        self.errors: list[str] = []
        self._random = random.Random(seed)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True, name=f"writer-{phase}")

    def start(self) -> None:
        self._thread.start()
        self._ready.wait(30)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _main(self) -> None:
        statement = self.outbox.insert(self.table)
        name = app_name(self.version, "writer", 0)
        sequence = 0
        interval = 1.0 / WRITER_RATE_PER_S
        conn: psycopg.Connection[Any] | None = None
        try:
            while not self._stop.is_set():
                if conn is None or conn.closed:
                    try:
                        conn = psycopg.connect(self.dsn, autocommit=True, application_name=name)
                    except psycopg.Error as exc:
                        self._failure(exc)
                        self._stop.wait(0.2)
                        continue
                    finally:
                        self._ready.set()
                key = f"{self.version}-{time.monotonic_ns()}-{sequence}"
                sequence += 1
                hold = self._random.choice((0.0, self._random.uniform(0.0, MAX_HOLD_S)))
                try:
                    with conn.transaction():
                        conn.execute(statement, self.outbox.params(key))
                        if hold:
                            time.sleep(hold)
                except psycopg.Error as exc:
                    self._failure(exc)
                else:
                    self.committed.append(key)
                self._stop.wait(interval)
        finally:
            self._ready.set()
            if conn is not None:
                conn.close()

    def _failure(self, exc: BaseException) -> None:
        self.failed += 1
        if len(self.errors) < 5:
            self.errors.append(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


class Straggler:
    """One slow request: BEGIN, INSERT, hold the transaction `hold_s`, COMMIT — running while
    the operator's next command does. Of the deployed version, or of the one a deploy
    replaces (its last request still in flight during a rolling deploy): the in-flight row
    that a precondition checked before taking the lock cannot see."""

    def __init__(
        self, dsn: str, phase: Phase, committed: list[str], hold_s: float,
        outbox: Outbox = DEFAULT_OUTBOX, bad: bool = False,
    ) -> None:  # fmt: skip
        self.dsn = dsn
        self.outbox = outbox
        self.bad = bad
        """A bad row (headers not a JSON object): dead-lettered, never published."""
        self.committed_key = ""
        self.version = phase.name
        self.table = table_for(phase)
        self.committed = committed
        self.hold_s = hold_s
        self.error = ""
        self._inserted = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True, name="straggler")

    def start(self) -> None:
        """Return once the row is inserted (uncommitted) or the INSERT failed."""
        self._thread.start()
        self._inserted.wait(30)

    def join(self) -> None:
        self._thread.join(60)

    def _main(self) -> None:
        statement = self.outbox.insert(self.table)
        kind = "bad" if self.bad else "straggler"
        key = f"{self.version}-{kind}-{time.monotonic_ns()}"
        try:
            with psycopg.connect(
                self.dsn, autocommit=True, application_name=app_name(self.version, "writer", 9)
            ) as conn:
                with conn.transaction():
                    conn.execute(statement, self.outbox.params(key, self.bad))
                    self._inserted.set()
                    time.sleep(self.hold_s)
                self.committed.append(key)
                self.committed_key = key
        except psycopg.Error as exc:
            self.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        finally:
            self._inserted.set()


class Publisher:
    """One relay instance of an application version: a real `Relay` in that version's mode
    (as the simulator configures it), publishing into the recording sink, in a thread.
    Restarted, its error kept, when it stopped on something the operator did.

    Not `sim.actors.relay_main`: that is a process entry point (it sets signal handlers,
    which only the main thread may)."""

    def __init__(
        self, dsn: str, phase: Phase, outbox: Outbox = DEFAULT_OUTBOX, slot: str = ""
    ) -> None:
        self.dsn = dsn
        self.phase = phase
        self.outbox = outbox
        self.slot = slot
        """The CDC relay's slot and publication (one per database: slots are the server's)."""
        self.errors: list[str] = []
        self.restarts = 0
        self._relay: Any = None
        self._thread: threading.Thread | None = None

    @property
    def mode(self) -> Mode | None:
        return relay_mode(self.phase)

    def start(self) -> None:
        from outbox_migrate.relay.worker import Relay

        mode = self.mode
        if mode is None:
            return
        name = app_name(self.phase.name, "relay", 0)
        spec = self.outbox.spec()
        if self.phase.app.renamed:
            spec = replace(
                spec, table=RENAMED_SPEC.table, partitioned_table=RENAMED_SPEC.partitioned_table
            )
        if self.outbox.cdc and mode is Mode.partitioned:
            self._start_cdc(spec, name)
            return
        relay = Relay(
            self.dsn, lambda: recording.RecordingSink(self.dsn, name), spec=spec,
            options=relay_options(mode, RELAY_BATCH), application_name=name,
        )  # fmt: skip
        self._launch(relay, f"relay-{self.phase.name}")

    def _start_cdc(self, spec: OutboxSpec, name: str) -> None:
        """The CDC relay (`relay --mode cdc`) in place of the partitioned one."""
        from outbox_migrate.relay.cdc.relay import CdcRelay

        options = CdcOptions(
            batch_size=RELAY_BATCH, slot=self.slot, publication=self.slot, mark_interval_s=0.05,
            failover=False,
        )  # fmt: skip
        relay = CdcRelay(
            self.dsn, lambda: recording.RecordingSink(self.dsn, name), spec=spec,
            options=options, application_name=name,
        )  # fmt: skip
        self._launch(relay, f"cdc-relay-{self.phase.name}")

    def _launch(self, relay: Any, thread_name: str) -> None:
        self._relay = relay
        self._thread = threading.Thread(
            target=self._run, args=(relay,), daemon=True, name=thread_name
        )
        self._thread.start()

    def _run(self, relay: Any) -> None:
        try:
            relay.run()
        except Exception as exc:  # kept for the report; the relay is restarted
            if len(self.errors) < 5:
                self.errors.append(f"{type(exc).__name__}: {exc}".splitlines()[0])

    def relay_switched(self) -> bool:
        """Whether this relay (switching mode) has left the flat table."""
        state = getattr(self._relay, "state", None)
        return state is not None and bool(state.switched)

    def keep_alive(self) -> None:
        """Restart a relay that stopped on an error (the error is kept for the report)."""
        if self._thread is not None and not self._thread.is_alive():
            self.restarts += 1
            time.sleep(RELAY_RESTART_PAUSE_S)
            self.start()

    def stop(self) -> None:
        if self._relay is None or self._thread is None:
            return
        self._relay.stop()
        self._thread.join(30)


@dataclass
class App:
    """The deployed application: one version's writer and relay.

    `deploy` starts the new version before stopping the old one (a rolling deploy: both run
    for a moment, as they would), writers first so what the old writer committed is still
    published by the old relay before it goes.

    The replaced version's last request (`deploy(..., last_request_s=...)`) begins while
    that version still runs, and commits after the deploy, during the operator's next
    command. It must begin before: a session of the old version opened once all of its
    sessions were gone is an old instance *reconnecting*, which the switching relay's
    `sessions` gate does not see by design (docs/relay.md, the switching rule). Modelled
    that way (as the fuzzer once did), HOP's V2 relay switched in the gap and the request's
    row was left in the old table for the operator's recovery: not the rolling deploy the
    fuzzer means to play.
    """

    dsn: str
    committed: list[str] = field(default_factory=list)
    outbox: Outbox = DEFAULT_OUTBOX
    slot: str = ""
    bad: list[str] = field(default_factory=list)
    """The committed bad rows' keys: dead-lettered, never published."""
    phase: Phase | None = None
    writer: Writer | None = None
    publisher: Publisher | None = None
    errors: list[str] = field(default_factory=list)
    stragglers: list[Straggler] = field(default_factory=list)

    def straggle(self, phase: Phase, hold_s: float, bad: bool = False) -> Straggler:
        """Start a slow request of `phase`'s version; it commits while the next command runs.
        `bad`: its row is one the relay cannot publish (recorded in `bad` once committed)."""
        straggler = Straggler(self.dsn, phase, self.committed, hold_s, self.outbox, bad)
        straggler.start()
        self.stragglers.append(straggler)
        return straggler

    def settle(self) -> None:
        """Wait for every slow request to end (commit or fail)."""
        for straggler in self.stragglers:
            straggler.join()
            if straggler.bad and straggler.committed_key:
                self.bad.append(straggler.committed_key)
            if straggler.error:
                self.errors.append(f"straggler {straggler.version}: {straggler.error}")
        self.stragglers.clear()

    def deploy(self, phase: Phase, last_request_s: float = 0.0) -> None:
        """Roll `phase`'s version out; with `last_request_s`, the replaced version has one
        request in flight, begun (its row inserted) before that version stops."""
        self.settle()
        writer = Writer(self.dsn, phase, self.committed, len(self.committed), self.outbox)
        publisher = Publisher(self.dsn, phase, self.outbox, self.slot)
        writer.start()
        publisher.start()
        if last_request_s and self.phase is not None:
            self.straggle(self.phase, last_request_s)
        self._stop_version()
        self.phase, self.writer, self.publisher = phase, writer, publisher

    def keep_alive(self) -> None:
        if self.publisher is not None:
            self.publisher.keep_alive()

    def stop(self) -> None:
        self.settle()
        self._stop_version()

    def _stop_version(self) -> None:
        """Stop the running version's writer and relay (its slow requests run on)."""
        if self.writer is not None:
            self.writer.stop()
            self.errors.extend(f"writer {self.writer.version}: {e}" for e in self.writer.errors)
        if self.publisher is not None:
            self.publisher.stop()
            self.errors.extend(
                f"relay {self.publisher.phase.name}: {e}" for e in self.publisher.errors
            )
        self.writer = self.publisher = None

    def committed_so_far(self) -> list[str]:
        return list(self.committed)

    def insert_errors(self) -> list[str]:
        """Every INSERT the application got an error for so far (writers and slow requests,
        the current writer included), `<who> <version>: <first line>`."""
        found = [e for e in self.errors if e.startswith(("writer ", "straggler "))]
        if self.writer is not None:
            found.extend(f"writer {self.writer.version}: {e}" for e in list(self.writer.errors))
        return found


TOLERATED_INSERT_ERRORS: dict[str, str] = {}
"""Classes of application INSERT errors a sequence may produce without failing, by a
substring of the error and the reason it is not the migration's fault. Empty: the runner's
promise is that an application version deployed in the playbook's order never sees an
INSERT fail, and the fuzzer's deploys follow that order (`deploy_next` only once the ledger
reached the phase; `deploy_previous` only back to a version the schema still serves). So any
insert error fails the sequence; add a class here only with its reason and a regression
test."""
RENAMED_VERSION_REFUSED: dict[str, str] = {
    'violates check constraint "outbox_is_retired"': "COP/HOP: the retired flat table is "
    "sealed, so the inserts of a version of the original name fail instead of waiting unseen",
    "violates partition constraint": "COPRA/HOPER/HOPIA: `outbox` is the DEFAULT partition "
    "again, which refuses unpublished rows",
}
"""The one exception, for the writers of the version of the original name only: the operator
rolled the rename back with that version still deployed (docs/patterns.md, "The final name":
roll the application back first). The schema refuses its rows loudly rather than strand them
(tests/integration/runner/test_rename_safety.py)."""


def intolerable(errors: list[str]) -> list[str]:
    """The insert errors not in a tolerated class."""
    renamed = ("writer original-name:", "straggler original-name:")
    return [
        e
        for e in errors
        if not any(k in e for k in TOLERATED_INSERT_ERRORS)
        and not (e.startswith(renamed) and any(k in e for k in RENAMED_VERSION_REFUSED))
    ]


def create_recording(dsn: str) -> None:
    recording.create(dsn)


OUTBOX_RELATIONS = """
SELECT c.oid::bigint, c.relname
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = 'public' AND c.relkind = 'r' AND c.relname <> %s
  AND EXISTS (SELECT FROM pg_attribute a
              WHERE a.attrelid = c.oid AND a.attname = 'message_key' AND NOT a.attisdropped)
ORDER BY c.relname
"""


def outbox_relations(conn: psycopg.Connection[Any]) -> dict[int, str]:
    """Every plain table (leaf partitions included) that holds outbox rows, by OID."""
    return dict(conn.execute(OUTBOX_RELATIONS, (recording.TABLE,)).fetchall())


def outbox_keys(conn: psycopg.Connection[Any]) -> dict[str, set[str]]:
    """Which tables hold each message key, over every outbox table that exists now.

    One statement, so one snapshot: a row the relay moves from the unpublished to the
    published partition meanwhile is seen in exactly one of them, never in neither.
    """
    names = list(outbox_relations(conn).values())
    if not names:
        return {}
    query = sql.SQL(" UNION ALL ").join(
        sql.SQL("SELECT {}::text, message_key FROM ONLY {}").format(
            sql.Literal(name), sql.Identifier(name)
        )
        for name in names
    )
    found: dict[str, set[str]] = {}
    for name, key in conn.execute(query).fetchall():
        found.setdefault(key, set()).add(name)
    return found


def published_keys(conn: psycopg.Connection[Any]) -> set[str]:
    return {
        k
        for (k,) in conn.execute(
            sql.SQL("SELECT DISTINCT message_key FROM {}").format(sql.Identifier(recording.TABLE))
        ).fetchall()
    }


def dead_lettered_keys(conn: psycopg.Connection[Any]) -> set[str]:
    """The message keys in the relay's dead-letter table (none before it exists)."""
    if conn.execute("SELECT to_regclass('public.outbox_dead_letter')").fetchone() == (None,):
        return set()
    return {k for (k,) in conn.execute("SELECT message_key FROM outbox_dead_letter").fetchall()}
