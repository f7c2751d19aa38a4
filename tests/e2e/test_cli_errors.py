"""Bad input from the command line: one line on stderr, exit code 2, no traceback, no password."""

from __future__ import annotations

import subprocess

from outbox_migrate_harness.testing.server import PASSWORD_ROLE, Server, free_port

from tests.support.cli import error_line, run_cli


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, env=env, timeout=60)


def assert_one_line_error(result: subprocess.CompletedProcess[str], *secrets: str) -> str:
    return error_line(result, 2, *secrets, only=True)


def test_unreachable_dsn() -> None:
    port = free_port()
    result = run("ping", "--dsn", f"postgresql://app:Sup3rSecret@127.0.0.1:{port}/app")
    line = assert_one_line_error(result, "Sup3rSecret")
    assert "cannot connect" in line and "****" in line


def test_wrong_password(pg_server: Server) -> None:
    if pg_server.origin != "binaries":
        import pytest

        pytest.skip("needs the suite's own server, which has a password-authenticated role")
    dsn = (
        f"host={pg_server.host} port={pg_server.port} user={PASSWORD_ROLE} "
        "dbname=postgres password=WrongPassw0rd"
    )
    line = assert_one_line_error(run("ping", "--dsn", dsn), "WrongPassw0rd")
    assert "password authentication failed" in line


def test_right_password_connects(pg_server: Server) -> None:
    from outbox_migrate_harness.testing.server import PASSWORD_ROLE_SECRET

    if pg_server.origin != "binaries":
        import pytest

        pytest.skip("needs the suite's own server, which has a password-authenticated role")
    dsn = (
        f"postgresql://{PASSWORD_ROLE}:{PASSWORD_ROLE_SECRET}@{pg_server.host}:{pg_server.port}"
        "/postgres"
    )
    result = run("ping", "--dsn", dsn, "--format", "json")
    assert result.returncode == 0, result.stderr
    assert PASSWORD_ROLE_SECRET not in result.stdout
    assert f'"major": {pg_server.version}' in result.stdout


def test_password_from_env_dsn_is_masked() -> None:
    port = free_port()
    result = run(
        "ping", env={"OUTBOX_MIGRATE_DSN": f"host=127.0.0.1 port={port} password=EnvPw999"}
    )
    assert_one_line_error(result, "EnvPw999")


def test_unknown_configuration_key() -> None:
    line = assert_one_line_error(run("config", env={"OUTBOX_MIGRATE_TABEL": "x"}))
    assert "'tabel'" in line and "OUTBOX_MIGRATE_TABEL" in line


def test_invalid_configuration_value() -> None:
    line = assert_one_line_error(run("config", env={"OUTBOX_MIGRATE_LOCK_TIMEOUT_MS": "soon"}))
    assert "lock_timeout_ms" in line and "must be an integer" in line


def test_unknown_option() -> None:
    line = assert_one_line_error(run("config", "--bogus"))
    assert "--bogus" in line


def test_no_database_given() -> None:
    line = assert_one_line_error(run("ping"))
    assert "--dsn" in line


def test_a_sink_option_without_a_value_is_refused_in_both_delivery_styles() -> None:
    """Refused before any connection (the address below answers nothing), whether the relay
    would poll or stream; the CDC relay had taken `linger.ms` as `linger.ms=` (empty)."""
    dsn = f"postgresql://127.0.0.1:{free_port()}/x"
    for mode in ("partitioned", "cdc"):
        line = assert_one_line_error(
            run(
                "relay",
                "--dsn",
                dsn,
                "--mode",
                mode,
                "--sink",
                "stdout",
                "--sink-option",
                "linger.ms",
            )
        )
        assert "--sink-option" in line and "KEY=VALUE" in line, (mode, line)
