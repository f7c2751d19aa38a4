"""A multi-host test bed on one machine: network namespaces joined to the host by veth pairs.

Host i is the namespace `<prefix>-i` with one veth pair: `10.77.i.1` on the root side
(`10.78…` for the second xdist worker, and so on) (where
PostgreSQL and the consumer listen) and `10.77.i.2` inside. A relay process runs in each
namespace (`ip netns exec`). Faults are per host and leave TCP without a reset, as a real
partition does:

* `link_down`: the root side of the host's veth goes down — nothing gets through either way;
* `packet_loss`: an nftables table inside the namespace drops every packet to and from the
  root side (silent loss, no ICMP, no RST);
* `sigstop`: the relay process is paused (its kernel keeps answering TCP);
* `broker_cut`: nftables drops only the consumer's port — PostgreSQL stays reachable.

Needs root, iproute2 (`ip`) and nftables (`nft`); see docs/development.md. Everything created
here is named with the prefix and removed by `Bed.close`, also after a failure.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


def _subnet() -> str:
    """One /16 per pytest-xdist worker (gw0: 10.77, gw1: 10.78, …): beds of parallel workers
    never share an address, so a relay of one bed cannot reach another bed's server."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    return f"10.{77 + int(worker or 0)}"


SUBNET = _subnet()
FAULTS = ("link_down", "packet_loss", "sigstop", "broker_cut")


def missing_tools() -> list[str]:
    return [tool for tool in ("ip", "nft") if shutil.which(tool) is None]


def run(*command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {result.stderr.strip()}")
    return result


@dataclass
class Host:
    index: int
    namespace: str
    outer: str
    inner: str

    @property
    def root_address(self) -> str:
        return f"{SUBNET}.{self.index}.1"

    @property
    def address(self) -> str:
        return f"{SUBNET}.{self.index}.2"


class Bed:
    """Namespaces and veth pairs for `hosts` hosts; a context manager that always cleans up."""

    def __init__(self, hosts: int, prefix: str | None = None) -> None:
        self.prefix = prefix or f"omf{os.getpid() % 100000}"
        self.hosts = [
            Host(i, f"{self.prefix}-{i}", f"{self.prefix}h{i}", f"{self.prefix}n{i}")
            for i in range(1, hosts + 1)
        ]

    def __enter__(self) -> Bed:
        try:
            for host in self.hosts:
                run("ip", "netns", "add", host.namespace)
                run("ip", "link", "add", host.outer, "type", "veth", "peer", "name", host.inner)
                run("ip", "link", "set", host.inner, "netns", host.namespace)
                run("ip", "addr", "add", f"{host.root_address}/24", "dev", host.outer)
                run("ip", "link", "set", host.outer, "up")
                self.ns(host, "ip", "addr", "add", f"{host.address}/24", "dev", host.inner)
                self.ns(host, "ip", "link", "set", host.inner, "up")
                self.ns(host, "ip", "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for host in self.hosts:
            run("ip", "link", "del", host.outer, check=False)  # removes the peer too
            run("ip", "netns", "del", host.namespace, check=False)

    def ns(self, host: Host, *command: str) -> subprocess.CompletedProcess[str]:
        return run("ip", "netns", "exec", host.namespace, *command)

    # -- faults ------------------------------------------------------------------------------

    def drop(self, host: Host, port: int | None = None) -> None:
        """Silently drop traffic between the namespace and the root side (or one port)."""
        match = f"tcp dport {port}" if port else ""
        reply = f"tcp sport {port}" if port else ""
        rules = (
            "table inet fault {\n"
            " chain out { type filter hook output priority 0; policy accept;\n"
            f"  ip daddr {host.root_address} {match} drop\n }}\n"
            " chain in { type filter hook input priority 0; policy accept;\n"
            f"  ip saddr {host.root_address} {reply} drop\n }}\n"
            "}\n"
        )
        subprocess.run(
            ["ip", "netns", "exec", host.namespace, "nft", "-f", "-"],
            input=rules, text=True, check=True, capture_output=True,
        )  # fmt: skip

    def heal(self, host: Host) -> None:
        run("ip", "netns", "exec", host.namespace, "nft", "delete", "table", "inet", "fault",
            check=False)  # fmt: skip
        run("ip", "link", "set", host.outer, "up", check=False)

    def link_down(self, host: Host) -> None:
        run("ip", "link", "set", host.outer, "down")


@dataclass
class Delivery:
    id: int
    key: str
    created_at: float
    arrived: float
    host: str


class Consumer:
    """The broker of the test bed: an HTTP endpoint on every host's root-side address that
    records each message it acknowledges (id, key, insert time, arrival time, sender)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.deliveries: list[Delivery] = []
        consumer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = 30.0  # a connection a fault cut never blocks its thread for good

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                arrived = time.time()
                with consumer.lock:
                    consumer.deliveries.extend(
                        Delivery(
                            int(e["id"]), str(e["key"]),
                            datetime.fromisoformat(e["created_at"]).timestamp(),
                            arrived, self.client_address[0],
                        )
                        for e in (body if isinstance(body, list) else [body])
                    )  # fmt: skip
                self.send_response(204)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                return None

        class Server(ThreadingHTTPServer):
            """Tracks its open connections: a relay cut off by a fault leaves its keep-alive
            connection open, its handler thread blocked on a read that never ends, and the
            socket — never closed — surfaced later as an unraisable ResourceWarning in an
            unrelated test."""

            request_queue_size = 256
            daemon_threads = True
            open_requests: set[socket.socket]

            def process_request(self, request: Any, client_address: Any) -> None:
                with consumer.lock:
                    self.open_requests.add(request)
                super().process_request(request, client_address)

            def shutdown_request(self, request: Any) -> None:
                with consumer.lock:
                    self.open_requests.discard(request)
                super().shutdown_request(request)

            def handle_error(self, request: Any, client_address: Any) -> None:
                return None  # a request cut short by a fault or by close()

        self.server = Server(("0.0.0.0", 0), Handler)
        self.server.open_requests = set()
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stop accepting, end every open connection, and wait for their handlers to close
        them (a blocked read returns once the socket is shut down)."""
        self.server.shutdown()
        with self.lock:
            open_requests = list(self.server.open_requests)
        for request in open_requests:
            with contextlib.suppress(OSError):
                request.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with self.lock:
                if not self.server.open_requests:
                    break
            time.sleep(0.01)
        with self.lock:
            for request in self.server.open_requests:
                request.close()
            self.server.open_requests.clear()
        self.server.server_close()
        # A socket of a connection a fault cut short can still be waiting for the garbage
        # collector (reference cycles through the handler): collect it here, where its
        # ResourceWarning is expected, not in whichever later test the collector runs.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()

    def snapshot(self) -> list[Delivery]:
        with self.lock:
            return list(self.deliveries)


@dataclass
class Relay:
    host: Host
    process: subprocess.Popen[bytes]
    log: Path


def start_relay(bed: Bed, host: Host, dsn: str, consumer: Consumer, log: Path,
                *options: str) -> Relay:  # fmt: skip
    url = f"http://{host.root_address}:{consumer.port}/hook"
    with log.open("wb") as err:
        process = subprocess.Popen(
            ["ip", "netns", "exec", host.namespace, sys.executable, "-m", "outbox_migrate",
             "relay", "--sink", "http", "--sink-url", url, "--dsn", dsn, *options,
             "--log-level", "info"],
            stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    return Relay(host, process, log)


def stop_relay(relay: Relay) -> None:
    if relay.process.poll() is None:
        relay.process.send_signal(signal.SIGCONT)
        relay.process.send_signal(signal.SIGTERM)
        try:
            relay.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            relay.process.kill()
            relay.process.wait()


@dataclass
class Figures:
    """What one fault did, from the consumer's record and the table."""

    fault: str
    inserted: int
    lost: int
    duplicates: int
    recover_s: float
    baseline_wait_s: float
    order_violations_first: int
    order_violations_raw: int
    per_host: dict[str, int] = field(default_factory=dict)

    def line(self) -> str:
        return (
            f"{self.fault:12s} inserted={self.inserted} lost={self.lost} "
            f"recover_s={self.recover_s:.1f} (normal wait {self.baseline_wait_s:.2f}) "
            f"duplicates={self.duplicates} order_violations={self.order_violations_first} "
            f"(raw, counting late duplicates: {self.order_violations_raw}) by_host={self.per_host}"
        )


def analyse(fault: str, inserted: list[int], deliveries: list[Delivery],
            fault_at: float) -> Figures:  # fmt: skip
    """Lost = inserted ids never acknowledged; duplicates = extra acknowledgements; recovery =
    the longest a message waited (insert or fault, whichever is later, to first delivery)
    among those inserted after the fault; order violations per key, over first deliveries and
    over every delivery."""
    first: dict[int, Delivery] = {}
    for d in deliveries:
        first.setdefault(d.id, d)
    lost = len(set(inserted) - set(first))
    duplicates = len(deliveries) - len(first)
    waits_after = [
        d.arrived - max(d.created_at, fault_at)
        for d in first.values()
        if d.created_at >= fault_at - 2
    ]
    waits_before = [d.arrived - d.created_at for d in first.values() if d.created_at < fault_at - 1]
    waits_before.sort()
    baseline = waits_before[int(len(waits_before) * 0.99)] if waits_before else 0.0

    def violations(sequence: list[Delivery]) -> int:
        top: dict[str, int] = {}
        count = 0
        for d in sequence:
            if d.id < top.get(d.key, 0):
                count += 1
            top[d.key] = max(top.get(d.key, 0), d.id)
        return count

    by_arrival = sorted(deliveries, key=lambda d: d.arrived)
    firsts = sorted(first.values(), key=lambda d: d.arrived)
    hosts: dict[str, int] = {}
    for d in deliveries:
        hosts[d.host] = hosts.get(d.host, 0) + 1
    return Figures(
        fault=fault,
        inserted=len(inserted),
        lost=lost,
        duplicates=duplicates,
        recover_s=max(waits_after, default=0.0),
        baseline_wait_s=baseline,
        order_violations_first=violations(firsts),
        order_violations_raw=violations(by_arrival),
        per_host=hosts,
    )
