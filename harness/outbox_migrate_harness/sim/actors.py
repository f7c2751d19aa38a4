"""The simulated application instances: writer and relay processes of one version, each with
its own connection and `application_name`, so deploy gates see them as real instances."""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from outbox_migrate.relay.options import Mode, RelayOptions, SwitchGate
from outbox_migrate_harness.sim.scenario import APP_NAME_PREFIX, Scenario, app_name

DEMO_INSERT = (
    "INSERT INTO {table} (event_type, message_key, payload) VALUES ('demo', %(key)s, '{{}}')"
)


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
    dsn: str, table: str, version: str, instance: int, scenario: Scenario,
    stop: Any, results: Any, ready: Any,
) -> None:  # fmt: skip
    """Insert one message at a time at this instance's share of the scenario's rate, each
    with a unique key, until `stop`. With `identity="id"` what is recorded as written is the
    id the INSERT returned, not the key."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    result = WriterResult(version, instance)
    statement = sql.SQL(scenario.insert_sql or DEMO_INSERT).format(
        table=sql.Identifier(scenario.spec.schema, table)
    )
    by_id = scenario.identity == "id"
    interval = scenario.writers / scenario.rate_per_s
    with psycopg.connect(
        dsn, autocommit=True, application_name=app_name(version, "writer", instance)
    ) as conn:
        ready.set()
        due = time.monotonic()
        sequence = 0
        while not stop.is_set():
            key = f"{version}-w{instance}-{sequence}"
            sequence += 1
            started = time.perf_counter()
            try:
                cursor = conn.execute(statement, {"key": key})
                returned = cursor.fetchone() if by_id else None
            except psycopg.Error as exc:
                result.failed += 1
                if len(result.errors) < 5:
                    result.errors.append(str(exc).splitlines()[0])
            else:
                result.written.append(str(returned[0]) if returned else key)
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


def relay_options(mode: Mode, batch_size: int) -> RelayOptions:
    """A simulated relay's options: the switching one waits for V1's sessions to end."""
    return RelayOptions(
        mode=mode, batch_size=batch_size, workers=1, shards=2, poll_interval_s=0.05,
        switch_gate=SwitchGate.sessions, old_app_name=f"{APP_NAME_PREFIX}/V1/%",
        shutdown_timeout_s=5.0,
    )  # fmt: skip


def relay_main(
    dsn: str, recording_dsn: str, version: str, instance: int, mode: Mode, scenario: Scenario,
    stop: Any, results: Any, ready: Any,
) -> None:  # fmt: skip
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from outbox_migrate.relay.worker import Relay
    from outbox_migrate_harness.sim.recording import RecordingSink

    name = app_name(version, "relay", instance)
    relay = Relay(
        dsn, lambda: RecordingSink(recording_dsn, name, identity=scenario.identity),
        spec=scenario.spec, options=relay_options(mode, scenario.batch_size),
        application_name=name,
    )  # fmt: skip

    def stop_when_told() -> None:
        stop.wait()
        relay.stop()

    threading.Thread(target=stop_when_told, daemon=True).start()
    ready.set()
    result = RelayResult(version, instance)
    try:
        relay.run()  # returns once stopped, the in-flight batch finished (or abandoned)
    except Exception as exc:  # noqa: BLE001 - reported to the parent as data
        result.error = f"{type(exc).__name__}: {exc}"
    result.stats = relay.stats.as_dict()
    results.put(("relay", result))
