"""CDC relay benchmark: transport choice and steady-load latency/CPU, side by side in one run.

Prints:
  1. the transport decision: draining 20,000 outbox inserts (100 transactions of 200 rows)
     from a pgoutput slot, wall time and consumer CPU, for (a) the replication protocol over
     psycopg 3's libpq layer with our decoder (what `relay --mode cdc` uses), (b) the SQL
     function pg_logical_slot_get_binary_changes polled over a normal psycopg 3 session,
     (c) psycopg2's LogicalReplicationConnection (only with --psycopg2-python, an interpreter
     that has psycopg2-binary), plus the CPU (b) burns polling an idle slot every 10 ms;
  2. steady load, 1,000 and 5,000 msg/s from 4 interleaved writer processes (writer k starts
     k/rate after the first) with plain single-row INSERTs: commit→delivery latency p50/p99
     and consumer CPU for pg_recvlogical (test_decoding, the floor), the "python floor" (the
     least a Python consumer does: our transport and decoder, one line per insert, nothing
     else), `relay --mode cdc` (default: marks every 0.1 s behind the
     stream; with `--mark-interval 0`; with `--no-mark`) and the polling relay (`--mode
     partitioned`), each a separate process printing to a pipe that this process reads in
     chunks (one timestamp per read, so the reader keeps up with pg_recvlogical's unbuffered
     writes at 5,000 msg/s). Ratios are against pg_recvlogical measured in the same run.
     The CDC rows run with the relay's default `--linger-ms` (or `--cdc-linger-ms`); each
     value of `--lingers` adds a row "cdc, linger N" (default marks) to show the trade-off.
     `wakes/msg`: the consumer's voluntary context switches (its sleeps, so its wake-ups)
     per message written.

It starts its own PostgreSQL 18 (fsync off, wal_level=logical). Default run: about 3 minutes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
from outbox_migrate_harness.testing import server as pgserver
from outbox_migrate_harness.testing.schema import create_partitioned_outbox

from outbox_migrate.config import OutboxSpec
from outbox_migrate.relay.cdc import pgoutput
from outbox_migrate.relay.cdc.stream import ReplicationStream

SPEC = OutboxSpec()
REPO = Path(__file__).resolve().parents[1]
DRAIN_ROWS = 20_000
DRAIN_TXN_ROWS = 200
IDLE_POLL_S = 0.01
IDLE_SECONDS = 5.0
PUBLICATION = "bench_pub"
WRITERS = 4
SETTLE_S = 2.0
DRAIN_TIMEOUT_S = 60.0
CONSUMERS = (
    "pg_recvlogical",
    "python floor",
    "cdc relay",
    "cdc, mark 0",
    "cdc, --no-mark",
    "polling relay",
)
PYTHON_FLOOR_SLOT = "bench_pyfloor"

# The least a Python consumer can do per wake-up: wait on the socket, take the frames libpq
# holds (our transport), decode the inserts (our decoder), write one line per message with
# one os.write per wake-up. No broker, no batches, no marks, no confirmations, no linger:
# what any Python relay pays before it does a relay's work (docs/relay.md, "the Python floor").
PYTHON_FLOOR = r"""
import os, select, sys
from outbox_migrate.relay.cdc import pgoutput
from outbox_migrate.relay.cdc.stream import ReplicationStream
stream = ReplicationStream(sys.argv[1], "bench python floor")
stream.start(sys.argv[2], sys.argv[3])
drain, insert_at, write, fd = stream.drain, pgoutput.insert_at, os.write, sys.stdout.fileno()
while True:
    frames = drain()
    if not frames:
        stream.wait(1.0)
        continue
    lines = [  # the bench's table: id, event_type, message_key, payload, ...
        '{"id":%s,"payload":%s}\n' % insert_at(f, 25).values[:4:3]
        for f in frames if f[0] == 0x77 and f[25] == 0x49
    ]
    if lines:
        write(fd, "".join(lines).encode())
"""

PSYCOPG2_DRAIN = r"""
import sys, time, psycopg2, psycopg2.extras
from outbox_migrate.relay.cdc import pgoutput
dsn, slot, pub, want = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
conn = psycopg2.connect(dsn, connection_factory=psycopg2.extras.LogicalReplicationConnection)
cur = conn.cursor()
cur.start_replication(slot_name=slot, decode=False,
                      options={"proto_version": "1", "publication_names": pub})
seen = 0
t0 = time.perf_counter(); c0 = time.process_time()
class Done(Exception): pass
def consume(msg):
    global seen
    if isinstance(pgoutput.decode(msg.payload), pgoutput.Insert):
        seen += 1
    if seen >= want:
        msg.cursor.send_feedback(flush_lsn=msg.data_start)
        raise Done
try:
    cur.consume_stream(consume)
except Done:
    pass
print(time.perf_counter() - t0, time.process_time() - c0)
"""


def _fresh(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for (name,) in conn.execute("SELECT slot_name FROM pg_replication_slots").fetchall():
            conn.execute("SELECT pg_drop_replication_slot(%s)", (name,))
        conn.execute("DROP PUBLICATION IF EXISTS bench_pub, outbox_migrate_cdc")
        conn.execute("DROP TABLE IF EXISTS outbox_new, outbox_dead_letter CASCADE")
        create_partitioned_outbox(conn, SPEC)
        conn.execute(
            f"CREATE PUBLICATION {PUBLICATION} FOR TABLE outbox_unpublished "
            "WITH (publish = 'insert')"
        )


# -- 1. transport --------------------------------------------------------------------------


def drain_stream(dsn: str, slot: str) -> tuple[float, float]:
    stream = ReplicationStream(dsn, "bench")
    t0, c0 = time.perf_counter(), time.process_time()
    stream.start(slot, PUBLICATION)
    seen = 0
    last = 0
    while seen < DRAIN_ROWS:
        frame = stream.read(5.0)
        if isinstance(frame, pgoutput.XLogData):
            if isinstance(pgoutput.decode(frame.payload), pgoutput.Insert):
                seen += 1
            last = frame.wal_end
    stream.confirm(last)
    result = time.perf_counter() - t0, time.process_time() - c0
    stream.close()
    return result


def drain_sql(dsn: str, slot: str) -> tuple[float, float]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        t0, c0 = time.perf_counter(), time.process_time()
        seen = 0
        while seen < DRAIN_ROWS:
            rows = conn.execute(
                "SELECT data FROM pg_logical_slot_get_binary_changes(%s, NULL, 2000, "
                "'proto_version', '1', 'publication_names', %s)",
                (slot, PUBLICATION),
            ).fetchall()
            for (data,) in rows:
                if isinstance(pgoutput.decode(data), pgoutput.Insert):
                    seen += 1
        return time.perf_counter() - t0, time.process_time() - c0


def idle_sql_cpu(dsn: str, slot: str) -> float:
    with psycopg.connect(dsn, autocommit=True) as conn:
        c0 = time.process_time()
        end = time.monotonic() + IDLE_SECONDS
        while time.monotonic() < end:
            conn.execute(
                "SELECT data FROM pg_logical_slot_get_binary_changes(%s, NULL, 2000, "
                "'proto_version', '1', 'publication_names', %s)",
                (slot, PUBLICATION),
            ).fetchall()
            time.sleep(IDLE_POLL_S)
        return time.process_time() - c0


def section_transport(dsn: str, psycopg2_python: str | None) -> None:
    _fresh(dsn)
    slots = ["t_stream", "t_sql", "t_idle"] + (["t_psycopg2"] if psycopg2_python else [])
    with psycopg.connect(dsn, autocommit=True) as conn:
        for name in slots:
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (name,))
        for _ in range(DRAIN_ROWS // DRAIN_TXN_ROWS):
            conn.execute(
                "INSERT INTO outbox_new (payload, message_key) SELECT "
                "json_build_object('n', g, 'pad', repeat('x', 100)), 'k' || g "
                "FROM generate_series(1, %s) g",
                (DRAIN_TXN_ROWS,),
            )
    results: dict[str, tuple[float, float]] = {}
    results["(a) replication protocol, psycopg 3 pq + own decoder"] = drain_stream(dsn, "t_stream")
    results["(b) pg_logical_slot_get_binary_changes, psycopg 3"] = drain_sql(dsn, "t_sql")
    if psycopg2_python:
        out = subprocess.run(
            [psycopg2_python, "-c", PSYCOPG2_DRAIN, dsn, "t_psycopg2", PUBLICATION,
             str(DRAIN_ROWS)],
            capture_output=True, text=True, timeout=120, check=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        wall, cpu = (float(x) for x in out.stdout.split())
        results["(c) psycopg2 LogicalReplicationConnection + own decoder"] = (wall, cpu)
    idle = idle_sql_cpu(dsn, "t_idle")
    print(f"\n## 1. Transport: drain {DRAIN_ROWS:,} inserts ({DRAIN_TXN_ROWS}-row transactions)")
    print(f"{'option':58} {'wall s':>7} {'CPU s':>7} {'rows/s':>9}")
    for name, (wall, cpu) in results.items():
        print(f"{name:58} {wall:7.2f} {cpu:7.2f} {DRAIN_ROWS / wall:9,.0f}")
    print(
        f"(b) polling an idle slot every {IDLE_POLL_S * 1000:.0f} ms: "
        f"{idle / IDLE_SECONDS * 100:.1f} % of a core in the client (its latency floor is "
        "the poll interval)"
    )


# -- 2. steady load ------------------------------------------------------------------------


def _writer(dsn: str, rate: float, seconds: float, queue: Any, start: float) -> None:
    """One paced writer from `start` (a `time.perf_counter()` value: CLOCK_MONOTONIC, the
    same clock in every process), one INSERT every 1/rate s."""
    out: list[tuple[int, float]] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        interval = 1.0 / rate
        n = 0
        while True:
            due = start + n * interval
            now = time.perf_counter()
            if now - start >= seconds:
                break
            if due > now:
                time.sleep(due - now)
            row = conn.execute(
                "INSERT INTO outbox_new (payload, message_key) VALUES "
                '(\'{"order": 42, "pad": "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"}\', \'k\') '
                "RETURNING id"
            ).fetchone()
            out.append((int(row[0]), time.time()))  # type: ignore[index]
            n += 1
    queue.put(out)


ID_JSON = re.compile(rb'^\{"id":(\d+),', re.MULTILINE)
ID_TEST_DECODING = re.compile(rb"INSERT: id\[bigint\]:(\d+)")


class Reader(threading.Thread):
    """Timestamps every id a consumer prints, as it arrives on the pipe.

    Reads whatever the pipe holds in one `os.read` (up to 1 MB), stamps it once and finds the
    ids with one regex pass over the chunk: per wake-up, not per line. The first version
    read line by line in Python, which `pg_recvlogical` (three lines and six unbuffered
    writes per transaction with test_decoding) outran at 5,000 msg/s: its lines queued in the
    pipe for seconds (p50 623 ms) and the floor measured this reader, not the consumer."""

    CHUNK = 1 << 20

    def __init__(self, pipe: Any, pattern: re.Pattern[bytes]) -> None:
        super().__init__(daemon=True)
        self.fd, self.pattern = pipe.fileno(), pattern
        self.seen: dict[int, float] = {}
        self.reads = 0

    def run(self) -> None:
        seen, finditer, read, fd = self.seen, self.pattern.finditer, os.read, self.fd
        tail = b""
        while chunk := read(fd, self.CHUNK):
            now = time.time()
            self.reads += 1
            cut = chunk.rfind(b"\n") + 1  # a line split across reads waits for its end
            if not cut:
                tail += chunk
                continue
            text, tail = tail + chunk[:cut], chunk[cut:]
            for found in finditer(text):
                seen.setdefault(int(found.group(1)), now)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a running process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wakes(pid: int) -> int:
    """Voluntary context switches of all of a process's threads (each one a sleep, so the
    wake-ups that follow), from /proc."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            text = status.read_text()
        except FileNotFoundError:  # a thread that just ended
            continue
        total += int(text.partition("voluntary_ctxt_switches:")[2].split()[0])
    return total


def _consumer(
    kind: str, dsn: str, server: pgserver.Server, linger_ms: float | None
) -> tuple[list[str], re.Pattern[bytes]]:
    python = [sys.executable, "-m", "outbox_migrate", "relay", "--sink", "stdout", "--dsn", dsn]
    if kind.startswith("cdc") and linger_ms is not None:
        python += ["--linger-ms", f"{linger_ms:g}"]
    if kind == "pg_recvlogical":
        params = psycopg.conninfo.conninfo_to_dict(dsn)
        base = [server.tool("pg_recvlogical"), "-h", str(params["host"]), "-p",
                str(params["port"]), "-U", "postgres", "-d", str(params["dbname"]),
                "-S", "bench_recv"]  # fmt: skip
        subprocess.run([*base, "--create-slot", "-P", "test_decoding"], check=True)
        return [*base, "--start", "-f", "-", "-F", "0"], ID_TEST_DECODING
    if kind == "python floor":
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (PYTHON_FLOOR_SLOT,)
            )
        return [sys.executable, "-c", PYTHON_FLOOR, dsn, PYTHON_FLOOR_SLOT, PUBLICATION], ID_JSON
    if kind == "cdc relay":
        return [*python, "--mode", "cdc"], ID_JSON
    if kind == "cdc, --no-mark":
        return [*python, "--mode", "cdc", "--no-mark"], ID_JSON
    if kind == "cdc, mark 0":  # the next mark as soon as the previous one committed
        return [*python, "--mode", "cdc", "--mark-interval", "0"], ID_JSON
    if kind.startswith("cdc, linger "):  # a variant row: the last --linger-ms wins
        return [*python, "--mode", "cdc", "--linger-ms", kind.removeprefix("cdc, linger ")], ID_JSON
    # No NOTIFY from the writers: poll every 10 ms so the polling relay's latency means
    # something (its default, 1 s, would dominate every figure).
    return [*python, "--mode", "partitioned", "--poll-interval", "0.01"], ID_JSON


def run_steady(
    kind: str,
    dsn: str,
    server: pgserver.Server,
    rate: int,
    seconds: float,
    linger_ms: float | None = None,
) -> dict[str, float]:
    _fresh(dsn)
    command, pattern = _consumer(kind, dsn, server, linger_ms)
    errors = tempfile.TemporaryFile()  # noqa: SIM115 - read back after the consumer exits
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, cwd=REPO)
    reader = Reader(proc.stdout, pattern)
    reader.start()
    time.sleep(SETTLE_S)
    cpu_start = _cpu_s(proc.pid)  # the consumer's own CPU from here on (not its start-up)
    wakes_start = _wakes(proc.pid)
    queue: Any = multiprocessing.Queue()
    # Interleaved: writer k starts k/rate after the first, so rows arrive evenly spaced for
    # every consumer (each writer used to start on its own clock once connected: random
    # phases, different for each consumer's run; bench/relay_steady.py found writers in
    # step halving a batching consumer's cost per message).
    start = time.perf_counter() + 0.5
    writers = [
        multiprocessing.Process(
            target=_writer, args=(dsn, rate / WRITERS, seconds, queue, start + k / rate)
        )
        for k in range(WRITERS)
    ]
    for w in writers:
        w.start()
    written: list[tuple[int, float]] = []
    for _ in writers:
        written.extend(queue.get())
    for w in writers:
        w.join()
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while len(reader.seen) < len(written) and time.monotonic() < deadline:
        time.sleep(0.05)
    cpu = _cpu_s(proc.pid) - cpu_start
    wakes = _wakes(proc.pid) - wakes_start
    proc.terminate()
    proc.wait(timeout=30)
    reader.join(timeout=5)
    if len(reader.seen) < len(written):
        errors.seek(0)
        tail = errors.read().decode(errors="replace").strip().splitlines()[-3:]
        print(f"  ({kind}: {len(written) - len(reader.seen)} not seen; stderr: {tail})")
    lat = sorted((reader.seen[i] - t) * 1000 for i, t in written if i in reader.seen)
    if kind == "pg_recvlogical":
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_drop_replication_slot('bench_recv')")
    return {
        "rows": len(written),
        "missing": len(written) - len(lat),
        "p50": statistics.median(lat) if lat else float("nan"),
        "p99": lat[int(len(lat) * 0.99) - 1] if lat else float("nan"),
        "cpu": cpu,
        "wakes": wakes / max(1, len(written)),
        "achieved": len(written) / seconds,
    }


def section_steady(
    dsn: str,
    server: pgserver.Server,
    rates: list[int],
    seconds: float,
    linger_ms: float | None = None,
    lingers: tuple[float, ...] = (),
) -> None:
    print(f"\n## 2. Steady load, {WRITERS} writers, single-row INSERTs, {seconds:.0f} s per run")
    default = "the relay's default" if linger_ms is None else f"{linger_ms:g} ms"
    print(f"(CDC rows: --linger-ms {default}, unless the row names one)")
    consumers = [*CONSUMERS[:5], *(f"cdc, linger {v:g}" for v in lingers), *CONSUMERS[5:]]
    print(
        f"{'rate':>6} {'consumer':16} {'achieved/s':>10} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'CPU s':>6} {'missing':>7} {'p99/floor':>9} {'CPU/floor':>9} {'wakes/msg':>9}"
    )
    for rate in rates:
        floor: dict[str, float] | None = None
        for kind in consumers:
            r = run_steady(kind, dsn, server, rate, seconds, linger_ms)
            if floor is None:
                floor = r
            print(
                f"{rate:6} {kind:16} {r['achieved']:10,.0f} {r['p50']:7.2f} {r['p99']:7.2f} "
                f"{r['cpu']:6.2f} {r['missing']:7.0f} {r['p99'] / floor['p99']:8.2f}x "
                f"{r['cpu'] / floor['cpu']:8.2f}x {r['wakes']:9.2f}",
                flush=True,
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="12", help="sections to run: 1, 2 or 12")
    parser.add_argument("--rates", default="1000,5000")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument(
        "--psycopg2-python", help="a Python with psycopg2-binary, to measure option (c)"
    )
    parser.add_argument("--dsn", help="an existing server with wal_level=logical (default: own)")
    parser.add_argument(
        "--cdc-linger-ms", type=float, help="--linger-ms for the CDC rows (default: the relay's)"
    )
    parser.add_argument(
        "--lingers", default="", help="comma-separated --linger-ms values, a CDC row each"
    )
    args = parser.parse_args(argv)
    server = None
    if args.dsn:
        dsn = args.dsn
        srv = pgserver.from_dsn(dsn)
    else:
        # synchronous_commit on: a walsender sends a transaction only once its WAL is flushed,
        # and with it off that waits for the WAL writer (up to 200 ms) — every consumer's
        # latency would measure wal_writer_delay. fsync stays off (the server's default here).
        settings = {"max_replication_slots": "10", "synchronous_commit": "on"}
        srv = server = pgserver.start(18, settings=settings)
        with psycopg.connect(srv.dsn(), autocommit=True) as conn:
            conn.execute("CREATE DATABASE bench")
        dsn = srv.dsn("bench")
    try:
        with psycopg.connect(dsn) as conn:
            print(f"# PostgreSQL {conn.info.server_version}, {os.cpu_count()} CPUs, "
                  f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
        if "1" in args.only:
            section_transport(dsn, args.psycopg2_python)
        if "2" in args.only:
            rates = [int(r) for r in args.rates.split(",")]
            lingers = tuple(float(v) for v in args.lingers.split(",") if v)
            section_steady(dsn, srv, rates, args.seconds, args.cdc_linger_ms, lingers)
        print(json.dumps({"done": True}))
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
