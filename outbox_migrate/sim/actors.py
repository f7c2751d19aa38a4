"""The simulated application instances: writer and relay processes of one version.

Each runs in its own process (spawned, so no state leaks from the parent), with its own
connection and `application_name`, so deploy gates see them exactly as they would see real
instances. Results come back through a queue when the instance stops.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

WRITE_STATEMENT = (
    "INSERT INTO {table} (event_type, message_key, payload) VALUES ('demo', %s, '{{}}')"
)


def _ignore_interrupts() -> None:
    """Ctrl-C in a terminal reaches the whole process group: the instances leave stopping to
    the parent (through their `stop` event), so they report their results instead of dying
    with a traceback each."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


@dataclass
class WriterResult:
    version: str
    instance: int
    written: list[str] = field(default_factory=list)
    failed: int = 0
    samples: list[tuple[float, float]] = field(default_factory=list)
    """(wall-clock time, insert latency in seconds) for every insert."""
    errors: list[str] = field(default_factory=list)


def writer_main(
    dsn: str, table: str, version: str, instance: int, rate_per_s: float,
    stop: Any, results: Any, ready: Any = None, schema: str = "public", insert_sql: str = "",
    identity: str = "key",
) -> None:  # fmt: skip
    """Insert one message at a time at `rate_per_s`, each with a unique key, until `stop`.

    `insert_sql` (see `Scenario.insert_sql`) replaces the demo's INSERT; with `identity="id"`
    what is recorded as written is the id the INSERT returned, not the key."""
    _ignore_interrupts()
    import psycopg
    from psycopg import sql

    from outbox_migrate.sim.scenario import app_name

    result = WriterResult(version, instance)
    if insert_sql:
        statement = sql.SQL(insert_sql).format(table=sql.Identifier(schema, table))
    else:
        statement = sql.SQL(
            WRITE_STATEMENT.replace("{table}", "{}").replace("%s", "%(key)s")
        ).format(sql.Identifier(table))
    interval = 1.0 / rate_per_s
    with psycopg.connect(
        dsn, autocommit=True, application_name=app_name(version, "writer", instance)
    ) as conn:
        if ready is not None:
            ready.set()
        due = time.monotonic()
        sequence = 0
        while not stop.is_set():
            key = f"{version}-w{instance}-{sequence}"
            sequence += 1
            started = time.perf_counter()
            try:
                returned = conn.execute(statement, {"key": key}).fetchone() if identity == "id" \
                    else conn.execute(statement, {"key": key})  # fmt: skip
            except psycopg.Error as exc:
                result.failed += 1
                if len(result.errors) < 5:
                    result.errors.append(str(exc).splitlines()[0])
            else:
                result.written.append(str(returned[0]) if isinstance(returned, tuple) else key)
            result.samples.append((time.time(), time.perf_counter() - started))
            due += interval
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            elif pause < -1.0:
                due = time.monotonic()  # fell far behind: do not burst to catch up
    results.put(("writer", result))


@dataclass
class RelayResult:
    version: str
    instance: int
    stats: dict[str, int] = field(default_factory=dict)
    error: str = ""


def relay_main(
    dsn: str, recording_dsn: str, version: str, instance: int, mode: str,
    old_app_pattern: str, batch_size: int, stop: Any, results: Any, ready: Any = None,
    spec: Any = None, identity: str = "key",
) -> None:  # fmt: skip
    """Run a `Relay` of this version until `stop`, publishing into the recording sink.

    `spec` (an `OutboxSpec`) names the outbox; `identity` what the sink records a delivery
    under (see `Scenario.identity`)."""
    _ignore_interrupts()
    from outbox_migrate.config import OutboxSpec
    from outbox_migrate.relay.options import Mode, RelayOptions, SwitchGate
    from outbox_migrate.relay.worker import Relay
    from outbox_migrate.sim.recording import RecordingSink
    from outbox_migrate.sim.scenario import app_name

    name = app_name(version, "relay", instance)
    options = RelayOptions(
        mode=Mode(mode),
        batch_size=batch_size,
        workers=1,
        shards=2,
        poll_interval_s=0.05,
        switch_gate=SwitchGate.sessions,
        old_app_name=old_app_pattern,
        shutdown_timeout_s=5.0,
    )
    relay = Relay(
        dsn, lambda: RecordingSink(recording_dsn, name, identity=identity),
        spec=spec or OutboxSpec(), options=options,
        application_name=name,
    )  # fmt: skip
    result = RelayResult(version, instance)
    failure: list[str] = []

    def run() -> None:
        try:
            relay.run()
        except Exception as exc:  # noqa: BLE001 - reported to the parent as data
            failure.append(f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    if ready is not None:
        ready.set()
    while not stop.is_set() and thread.is_alive():
        stop.wait(0.1)
    relay.stop()
    thread.join(15)
    result.stats = relay.stats.as_dict()
    result.error = failure[0] if failure else ""
    results.put(("relay", result))
