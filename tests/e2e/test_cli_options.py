"""One set of naming options on every command, enumerations as choices, ranges checked before
any work (issue 14: `run` took only --schema/--table, `--to`/`--mode`/`--ordering` took any
string, and out-of-range values failed at runtime or were silently accepted)."""

from __future__ import annotations

import json
from dataclasses import fields, replace

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox

from outbox_migrate.config import OutboxSpec
from outbox_migrate.errors import ExitCode
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
    (["relay", "--sink", "stdout", "--session-timeout", "-3"], {}, "--session-timeout"),
    (["status", "--watch", "--interval", "inf"], {}, "--interval"),
    (["copy-back", "--max-replica-lag", "inf"], {}, "--max-replica-lag"),
    (["relay", "--sink", "stdout", "--session-timeout", "nan"], {}, "--session-timeout"),
    (["relay", "--sink", "stdout", "--workers", "4", "--shards", "2"], {}, "--shards"),
    (["relay", "--sink", "stdout", "--log-level", "loud"], {}, "--log-level"),
    (["wizard", "--no-pause", "--table", ""], {}, "table"),
    # Every command that reads a setting takes it (these were "No such option"):
    (["next", "-p", "hoper", "--lock-budget-s", "inf"], {}, "--lock-budget-s"),
    (["rollback", "-p", "hoper", "--to", "V1", "--lock-timeout-ms", "99999999999"], {}, "--lock-timeout-ms"),
    (["run", "-p", "hoper", "--to", "V2", "--gate-window-s", "0"], {}, "--gate-window-s"),
    (["verify", "--gate-window-s", "-1"], {}, "--gate-window-s"),
    (["copy-back", "--lock-budget-s", "nan"], {}, "--lock-budget-s"),
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
    assert "no such option" not in line.lower()  # refused for its value, not unknown


def test_settings_are_options_of_the_commands_that_read_them() -> None:
    result = run_cli(
        "config", "--format", "json", "--old-app-name", "billing-v1%", "--gate-window-s", "5",
        "--lock-budget-s", "30",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["old_app_name"] == {"value": "billing-v1%", "source": "--old-app-name"}
    assert doc["gate_window_s"] == {"value": 5.0, "source": "--gate-window-s"}
    assert doc["lock_budget_s"] == {"value": 30.0, "source": "--lock-budget-s"}


def test_to_takes_the_phase_as_the_docs_write_it_in_any_case() -> None:
    """`--to` listed its choices in lower case (`'V9' is not one of 'v1', …`) while every doc
    writes V2; input is case-insensitive, help and errors use the docs' spelling."""
    refused = run_cli("run", "-p", "hoper", "--to", "V9", "--dsn", "host=127.0.0.1 port=1")
    line = error_line(refused, ExitCode.USAGE, only=True)
    assert "V1, V2, V3, V4, copy-back" in line and "'v1'" not in line
    helped = run_cli("rollback", "--help")
    assert "V1|V2|V3|V4|copy-back" in helped.stdout
    # Lower case is accepted: the command gets as far as the (unreachable) database.
    lower = run_cli("run", "-p", "hoper", "--to", "v2", "--dsn", "host=127.0.0.1 port=1 dbname=x")
    assert "--to" not in error_line(lower, ExitCode.USAGE)
