"""One set of naming options on every command, enumerations as choices, ranges checked before
any work (issue 14: `run` took only --schema/--table, `--to`/`--mode`/`--ordering` took any
string, and out-of-range values failed at runtime or were silently accepted)."""

from __future__ import annotations

import json
from dataclasses import fields, replace

import psycopg
import pytest

from outbox_migrate.config import OutboxSpec
from outbox_migrate.errors import ExitCode
from outbox_migrate.testing.schema import create_flat_outbox
from tests.support.cli import error_line, run_cli

TABLE_COMMANDS = [
    ("run",), ("next",), ("status",), ("verify",), ("rollback",), ("reset",), ("plan",),
    ("relay",), ("copy-back",), ("maintain",), ("alembic", "generate"), ("wizard",), ("config",),
]  # fmt: skip


@pytest.mark.parametrize("command", TABLE_COMMANDS, ids=" ".join)
def test_every_table_command_takes_every_name(command: tuple[str, ...]) -> None:
    """Generated from OutboxSpec: a field added to the spec is an option everywhere."""
    helped = run_cli(*command, "--help")
    assert helped.returncode == 0, helped.stderr
    for field in fields(OutboxSpec):
        assert "--" + field.name.replace("_", "-") in helped.stdout, (command, field.name)


def test_names_keep_their_precedence() -> None:
    result = run_cli(
        "config", "--format", "json", "--table", "from_flag",
        env={"OUTBOX_MIGRATE_TABLE": "from_env", "OUTBOX_MIGRATE_PUBLISHED_COLUMN": "sent_at"},
    )  # fmt: skip
    doc = json.loads(result.stdout)
    assert doc["table"] == {"value": "from_flag", "source": "--table"}
    assert doc["published_column"] == {
        "value": "sent_at",
        "source": "OUTBOX_MIGRATE_PUBLISHED_COLUMN",
    }


@pytest.mark.newest_pg_only
def test_run_with_custom_names(dsn: str) -> None:
    """`run --schema billing --table event_outbox` failed inside step 1 because `run` could
    not be told the publication column's name."""
    spec = replace(OutboxSpec(), schema="billing", table="event_outbox", published_column="sent_at")
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn, spec)
    names = ["--schema", "billing", "--table", "event_outbox", "--published-column", "sent_at"]
    result = run_cli("run", "-p", "hoper", "--to", "V2", "--dsn", dsn, *names)
    assert result.returncode == 0, result.stderr
    status = json.loads(run_cli("status", "--dsn", dsn, "--format", "json", *names).stdout)
    assert (status["table"], status["phase"]) == ("billing.event_outbox", "V2")
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT to_regclass('billing.outbox_new')").fetchone() != (None,)


BAD_INPUT = [
    (["run", "-p", "hoper", "--to", "V9"], {}, "--to"),
    (["run", "-p", "hoper", "--to", "V2", "--on-long-tx", "maybe"], {}, "--on-long-tx"),
    (["run", "-p", "hoper", "--to", "V2", "--lock-timeout-ms", "99999999999"], {}, "--lock-timeout-ms"),
    (["run", "-p", "hoper", "--to", "V2"], {"OUTBOX_MIGRATE_LOCK_BUDGET_S": "inf"}, "OUTBOX_MIGRATE_LOCK_BUDGET_S"),
    (["run", "-p", "hoper", "--to", "V2", "--id-kind", "random"], {}, "--id-kind"),
    (["relay", "--sink", "stdout", "--mode", "sideways"], {}, "--mode"),
    (["relay", "--sink", "stdout", "--ordering", "alphabetical"], {}, "--ordering"),
    (["relay", "--sink", "stdout", "--metrics-port", "70000"], {}, "--metrics-port"),
    (["relay", "--sink", "stdout", "--sink-timeout", "-1"], {}, "--sink-timeout"),
    (["relay", "--sink", "stdout", "--workers", "4", "--shards", "2"], {}, "--shards"),
    (["relay", "--sink", "stdout", "--log-level", "loud"], {}, "--log-level"),
    (["wizard", "--no-pause", "--table", ""], {}, "table"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "env", "named"), BAD_INPUT, ids=lambda v: str(v)[:40])
def test_bad_values_are_refused_before_any_work(
    args: list[str], env: dict[str, str], named: str
) -> None:
    """No database is reachable at this DSN: a value refused at parse time never gets to
    try it, so the error is about the option, not the connection."""
    result = run_cli(*args, "--dsn", "host=127.0.0.1 port=1 dbname=none", env=env)
    line = error_line(result, ExitCode.USAGE, only=True)
    assert named in line and "connect" not in line
