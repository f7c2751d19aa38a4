"""HTTP producer limit: the relay's HTTP sink against Python HTTP clients posting flat out.

One webhook receiver runs in another process (asyncio Protocol, HTTP/1.1 keep-alive, answers
200 with an empty body as soon as a request's body is in). Against it, side by side in one run,
for message bodies of about 200 B and 2 KB:

- the producers: httpx (N threads, an `httpx.Client` each; its `AsyncClient`
  from N tasks spent milliseconds of CPU per request here, so it is left out), urllib3 (an
  `HTTPConnectionPool` of N connections, N threads) and aiohttp (a `ClientSession`, N
  tasks) — one message per POST, the relay's body and headers for that message
  (`Message.envelope()`, `request_headers`, built before the clock starts), N requests in
  flight, N = the HTTP sink's lanes (its `concurrency`, default 16), timed to the last 200
  received. The fastest of them is the producer limit. `http.client` with one connection per
  thread (what the sink's lanes use) is printed beside them for reference, not in the limit;
- SQL-only: the relay's claim+mark as one statement until the outbox is empty, no broker
  (bench/relay.py's `sql_only`), on the same rows;
- the relay: `outbox_migrate.relay.Relay`, one worker, the real `http` sink from the sink
  factory (`--ordering none`, every key distinct, so 16 lanes), draining the same number of rows
  of the same size from the throwaway PostgreSQL, timed from start to empty.

Per contender: msg/s (median of --reps, contenders interleaved, their order rotated each
repetition), the publishing process's CPU per request (`time.process_time()` of this process:
the webhook's CPU is not in it; for the relay it includes the claim and the mark), the mean body
size the webhook received (the relay's and the producers' must match) and the webhook's own CPU
share of its wall time (well below 100 %: the receiver is not what limits). Then the relay
against min(fastest producer, SQL-only) — goal ≥ 80 % — and the relay's CPU per request —
goal ≤ 470 µs.

Default run: a few minutes on 2 vCPUs. Needs `pip install -e '.[bench]'` (httpx, urllib3,
aiohttp). Example: PYTHONPATH=. python bench/producers_http.py --rows 20000 --reps 5
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import itertools
import multiprocessing as mp
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
import relay_steady as steady
from outbox_migrate_harness.testing import server as pgserver
from outbox_migrate_harness.testing.schema import create_partitioned_outbox, insert_rows
from psycopg import sql
from relay import INDEX_PLAN, SPEC, sql_only

from outbox_migrate.cli.relay_cmd import RELAY_SWITCH_INTERVAL_S
from outbox_migrate.relay import sinks
from outbox_migrate.relay.message import Message
from outbox_migrate.relay.options import Ordering, RelayOptions
from outbox_migrate.relay.sinks.envelopes import CloudEvents, Envelope
from outbox_migrate.relay.sinks.http import DEFAULT_CONCURRENCY, request_headers
from outbox_migrate.relay.worker import Relay

TABLE = "outbox_new"
ID_START = 1_000_000_000
HOOK_PATH = "/hook"

# -- the webhook (another process) -------------------------------------------------------------

_OK = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"


class _Tally:
    requests = 0
    body_bytes = 0


class _Hook(asyncio.Protocol):
    """Parses pipelined or partial HTTP/1.1 requests from a byte buffer: no per-request task,
    no StreamReader, so a request costs the receiver a few µs of Python."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.need = -1
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        out: list[bytes] = []
        while True:
            if self.need < 0:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    break
                head = bytes(buf[:end]).lower()
                del buf[: end + 4]
                at = head.find(b"content-length:")
                length = 0
                if at >= 0:
                    stop = head.find(b"\r\n", at)
                    length = int(head[at + 15 : stop if stop >= 0 else len(head)])
                if head.startswith(b"get /stats"):  # the bench's own question, not counted
                    text = f"{_Tally.requests} {_Tally.body_bytes} {time.process_time()}"
                    out.append(
                        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s"
                        % (len(text), text.encode())
                    )
                    continue
                self.need = length
            if len(buf) < self.need:
                break
            del buf[: self.need]
            _Tally.requests += 1
            _Tally.body_bytes += self.need
            self.need = -1
            out.append(_OK)
        if out and self.transport is not None:
            self.transport.write(b"".join(out))


def _serve(ready: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops it

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(_Hook, "127.0.0.1", 0, backlog=512)
        ready.send(server.sockets[0].getsockname()[1])
        await asyncio.Event().wait()

    asyncio.run(main())


class Webhook:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child,), daemon=True)
        self.process.start()
        if not parent.poll(30):
            raise RuntimeError("the webhook did not start")
        self.port = int(parent.recv())
        self.url = f"http://127.0.0.1:{self.port}{HOOK_PATH}"

    def stats(self) -> tuple[int, int, float]:
        """(requests, body bytes, the receiver's CPU seconds) so far."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", "/stats")
            requests, body_bytes, cpu = conn.getresponse().read().decode().split()
        finally:
            conn.close()
        return int(requests), int(body_bytes), float(cpu)

    def stop(self) -> None:
        self.process.terminate()
        self.process.join(5)


# -- the producers -----------------------------------------------------------------------------

Item = tuple[bytes, dict[str, str]]
Producer = Callable[[str, Sequence[Item], int], int]
"""(url, bodies and headers, requests in flight) → how many were answered 200."""


def _threads(count: int, work: Callable[[Callable[[], int]], int]) -> int:
    """Run `work(next_index)` on `count` threads sharing one index; the sum of their counts."""
    total = 0
    lock = threading.Lock()
    counter = itertools.count()

    def body() -> None:
        nonlocal total
        done = work(lambda: next(counter))
        with lock:
            total += done

    threads = [threading.Thread(target=body) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return total


def http_client_threads(url: str, items: Sequence[Item], inflight: int) -> int:
    """The standard library: one keep-alive `HTTPConnection` per thread (the sink's lanes)."""
    port = int(url.split(":")[2].split("/", maxsplit=1)[0])

    def work(take: Callable[[], int]) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        ok = 0
        while (i := take()) < len(items):
            body, headers = items[i]
            conn.request("POST", HOOK_PATH, body, headers)
            response = conn.getresponse()
            response.read()
            ok += response.status == 200
        conn.close()
        return ok

    return _threads(inflight, work)


def httpx_threads(url: str, items: Sequence[Item], inflight: int) -> int:
    """One `httpx.Client` per thread: one Client shared by the threads lost a request now and
    then to a race in its connection pool (`ReadError: [Errno 9] Bad file descriptor`)."""
    import httpx

    def work(take: Callable[[], int]) -> int:
        ok = 0
        with httpx.Client(timeout=10.0) as client:
            while (i := take()) < len(items):
                body, headers = items[i]
                ok += client.post(url, content=body, headers=headers).status_code == 200
        return ok

    return _threads(inflight, work)


def urllib3_threads(url: str, items: Sequence[Item], inflight: int) -> int:
    import urllib3

    port = int(url.split(":")[2].split("/", maxsplit=1)[0])
    # block=True: at most `inflight` connections, reused; retries=False: one attempt per
    # request, the cheapest path urllib3 offers (a retry would only cost more).
    with urllib3.HTTPConnectionPool("127.0.0.1", port, maxsize=inflight, block=True) as pool:

        def work(take: Callable[[], int]) -> int:
            ok = 0
            while (i := take()) < len(items):
                body, headers = items[i]
                response = pool.urlopen(
                    "POST", HOOK_PATH, body=body, headers=headers, retries=False
                )
                ok += response.status == 200
            return ok

        return _threads(inflight, work)


def aiohttp_tasks(url: str, items: Sequence[Item], inflight: int) -> int:
    import aiohttp

    async def main() -> int:
        connector = aiohttp.TCPConnector(limit=inflight)
        async with aiohttp.ClientSession(connector=connector) as session:
            counter = itertools.count()

            async def task() -> int:
                ok = 0
                while (i := next(counter)) < len(items):
                    body, headers = items[i]
                    async with session.post(url, data=body, headers=headers) as response:
                        await response.read()
                        ok += response.status == 200
                return ok

            return sum(await asyncio.gather(*(task() for _ in range(inflight))))

    return asyncio.run(main())


PRODUCERS: dict[str, Producer] = {
    "httpx": httpx_threads,
    "urllib3": urllib3_threads,
    "aiohttp": aiohttp_tasks,
}
REFERENCE: dict[str, Producer] = {"http.client": http_client_threads}


# -- messages and rows -------------------------------------------------------------------------


def sample_message(i: int, pad: int) -> Message:
    """A message as the relay claims it from `insert_rows`' rows (same fields, same sizes)."""
    payload = f'{{"n" : {i}, "pad" : "{"x" * pad}"}}'  # json_build_object's rendering
    key = f"k-{i}-{'0' * 32}"
    created = "2026-11-28T10:00:00.123456+00:00"
    table = f"{SPEC.schema}.{SPEC.outbox_name}"  # the outbox's name, as the relay's claim says
    return Message(ID_START + i, table, "event", key, payload, created)


def pad_for(size: int) -> int:
    """The payload padding that makes a message's JSON envelope `size` bytes."""
    return max(0, size - len(sample_message(1, 0).envelope().encode()))


def items_for(rows: int, pad: int) -> list[Item]:
    ce = CloudEvents({})
    out = []
    for i in range(1, rows + 1):
        message = sample_message(i, pad)
        out.append((message.envelope().encode(), request_headers(message, Envelope.json, ce)))
    return out


def refill(conn: psycopg.Connection, rows: int, pad: int) -> None:
    conn.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier(SPEC.schema, TABLE)))
    insert_rows(conn, TABLE, rows, spec=SPEC, payload_bytes=pad)
    conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(SPEC.schema, TABLE)))


def unpublished(conn: psycopg.Connection) -> int:
    row = conn.execute("SELECT count(*) FROM outbox_unpublished").fetchone()
    return int(row[0]) if row else -1


# -- runs --------------------------------------------------------------------------------------


@dataclass
class Run:
    rate: float
    cpu_us: float
    """This process's CPU per request, µs."""
    body: float
    """Mean body bytes the webhook received per request (0 when none was sent)."""
    hook_busy: float
    """The webhook's CPU seconds / wall seconds."""


@dataclass
class Runs:
    runs: list[Run] = field(default_factory=list)

    def median(self, attr: str) -> float:
        return float(statistics.median(getattr(r, attr) for r in self.runs))


def timed(webhook: Webhook, rows: int, go: Callable[[], object]) -> Run:
    """Run `go` and time it: wall, this process's CPU, what the webhook got meanwhile."""
    before = webhook.stats()
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    go()
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    after = webhook.stats()
    requests = after[0] - before[0]
    body = (after[1] - before[1]) / requests if requests else 0.0
    return Run(rows / wall, cpu / rows * 1e6, body, (after[2] - before[2]) / wall)


def producer_run(webhook: Webhook, producer: Producer, items: Sequence[Item], inflight: int) -> Run:
    answered = 0

    def go() -> None:
        nonlocal answered
        answered = producer(webhook.url, items, inflight)

    run = timed(webhook, len(items), go)
    assert answered == len(items), f"{answered} of {len(items)} answered 200"
    return run


def sql_run(
    webhook: Webhook, dsn: str, conn: psycopg.Connection, rows: int, pad: int, batch: int
) -> Run:
    refill(conn, rows, pad)
    run = timed(webhook, rows, lambda: sql_only(dsn, batch, 1, sharded=False))
    assert unpublished(conn) == 0
    return run


def relay_run(
    webhook: Webhook, dsn: str, conn: psycopg.Connection, rows: int, pad: int, batch: int
) -> Run:
    refill(conn, rows, pad)
    config = sinks.SinkConfig(url=webhook.url, ordering=Ordering.none)
    relay = Relay(
        dsn,
        sinks.factory("http", config),
        spec=SPEC,
        options=RelayOptions(
            batch_size=batch, workers=1, until_empty=True, listen=False, ordering=Ordering.none
        ),
    )
    run = timed(webhook, rows, relay.run)
    assert relay.stats.published == rows and unpublished(conn) == 0, relay.stats
    return run


def check_plan(dsn: str, batch: int) -> None:
    """The SQL-only baseline runs on the index plan (bench/relay.py's INDEX_PLAN)."""
    from relay import plan

    print(
        f"(SQL-only plan at batch {batch}: {plan(dsn, batch)}; session settings "
        f"{'; '.join(INDEX_PLAN)})"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000, help="messages per run")
    parser.add_argument("--reps", type=int, default=3, help="runs per figure (median)")
    parser.add_argument("--sizes", default="200,2048", help="body sizes in bytes, comma list")
    parser.add_argument(
        "--batch",
        type=int,
        default=RelayOptions().batch_size,
        help="the relay's and SQL-only's batch size (default: the relay's)",
    )
    parser.add_argument(
        "--inflight",
        type=int,
        default=DEFAULT_CONCURRENCY,
        help="producers' requests in flight (default: the sink's lanes)",
    )
    args = parser.parse_args(argv)

    started = time.perf_counter()
    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(143))
    sys.setswitchinterval(RELAY_SWITCH_INTERVAL_S)  # as `outbox-migrate relay` runs
    sizes = [int(s) for s in args.sizes.split(",")]
    contenders = [*PRODUCERS, *REFERENCE, "SQL-only", "relay"]
    results: dict[tuple[int, str], Runs] = {(s, c): Runs() for s in sizes for c in contenders}
    webhook = Webhook()
    srv = pgserver.start(18, settings={"autovacuum": "off"})
    try:
        dsn = srv.dsn()
        print(
            f"PostgreSQL {srv.full_version}, {os.cpu_count()} CPUs, fsync off (throwaway); "
            f"{steady.load_note()} at start"
        )
        print(
            f"{args.rows:,} messages per run, {args.inflight} in flight, relay batch "
            f"{args.batch}, median of {args.reps}; switch interval {RELAY_SWITCH_INTERVAL_S} s"
        )
        with psycopg.connect(dsn, autocommit=True) as conn:
            create_partitioned_outbox(conn, SPEC, start=ID_START)
            check_plan(dsn, args.batch)
            work = {size: items_for(args.rows, pad_for(size)) for size in sizes}
            for size in sizes:  # warm-up: imports, connections, the server's caches
                producers = {**PRODUCERS, **REFERENCE}
                for producer in producers.values():
                    producer_run(webhook, producer, work[size][:500], args.inflight)
                relay_run(webhook, dsn, conn, 500, pad_for(size), args.batch)
            for rep in range(args.reps):
                shift = rep % len(contenders)
                order = contenders[shift:] + contenders[:shift]
                for size in sizes:
                    pad = pad_for(size)
                    for name in order:
                        if name == "SQL-only":
                            run = sql_run(webhook, dsn, conn, args.rows, pad, args.batch)
                        elif name == "relay":
                            run = relay_run(webhook, dsn, conn, args.rows, pad, args.batch)
                        else:
                            producer = {**PRODUCERS, **REFERENCE}[name]
                            run = producer_run(webhook, producer, work[size], args.inflight)
                        results[size, name].runs.append(run)
                print(f"(repetition {rep + 1} done, {steady.load_note()})", flush=True)
    finally:
        srv.stop()
        webhook.stop()
    report(results, sizes, contenders)
    print(f"\n({steady.load_note()} at the end; total {time.perf_counter() - started:.0f} s)")


def report(results: dict[tuple[int, str], Runs], sizes: list[int], contenders: list[str]) -> None:
    print(
        f"\n{'size':>5} {'contender':<12} {'msg/s':>7} {'CPU µs/req':>10} {'body B':>6} "
        f"{'hook CPU':>8}  runs msg/s"
    )
    for size in sizes:
        for name in contenders:
            runs = results[size, name]
            label = f"{name}*" if name in REFERENCE else name
            body = f"{runs.median('body'):>6.0f}" if name != "SQL-only" else f"{'-':>6}"
            all_runs = ", ".join(f"{r.rate:,.0f}" for r in runs.runs)
            print(
                f"{size:>5} {label:<12} {runs.median('rate'):>7,.0f} "
                f"{runs.median('cpu_us'):>10,.0f} {body} "
                f"{runs.median('hook_busy'):>8.0%}  {all_runs}"
            )
    print(
        f"\n{'size':>5} {'producer limit':<22} {'SQL-only':>8} {'relay':>7} "
        f"{'relay/min':>9} {'goal':>5} {'relay CPU µs/req':>16} {'goal':>5}"
    )
    for size in sizes:
        best = max(PRODUCERS, key=lambda n: results[size, n].median("rate"))
        limit = results[size, best].median("rate")
        sql_rate = results[size, "SQL-only"].median("rate")
        relay = results[size, "relay"].median("rate")
        ratio = relay / min(limit, sql_rate)
        cpu = results[size, "relay"].median("cpu_us")
        print(
            f"{size:>5} {f'{limit:,.0f} ({best})':<22} {sql_rate:>8,.0f} {relay:>7,.0f} "
            f"{ratio:>9.0%} {'ok' if ratio >= 0.8 else 'MISS':>5} {cpu:>16,.0f} "
            f"{'ok' if cpu <= 470 else 'MISS':>5}"
        )
    print(
        "(relay/min: the relay against the slower of the fastest producer and SQL-only, goal "
        "≥ 80 %; relay CPU: this process's CPU per message, claim and mark included, goal "
        "≤ 470 µs; hook CPU: the webhook process's CPU share of the run's wall; *: the sink's "
        "own client, bare, for reference, not in the producer limit)"
    )


if __name__ == "__main__":
    main()
