"""The playbooks' main path runs as printed: each phase's `outbox-migrate run` command, in
order, takes a real outbox from V1 to the pattern's last phase with exit 0.

Between phases an operator deploys the next version; here no application runs, so every
deploy gate sees what it would after a finished rollout (no writer of the old version left,
every message of the old table published by its relay).
"""

from __future__ import annotations

import re
from typing import Any

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox

from outbox_migrate.patterns import PATTERN_NAMES
from outbox_migrate.playbook import render_playbook
from tests.support.cli import run_cli

COMMAND = re.compile(r"`outbox-migrate (run --to [^`]*?) --dsn <DSN>`")


@pytest.mark.parametrize("pattern", PATTERN_NAMES)
def test_every_run_command_of_the_playbook_runs_in_order(
    pattern: str, conn: psycopg.Connection[Any], dsn: str
) -> None:
    create_flat_outbox(conn)
    conn.execute(
        "INSERT INTO outbox (event_type, message_key, payload, published_at) "
        "SELECT 'e', 'k' || n, '{}', now() FROM generate_series(1, 20) n"
    )
    commands = COMMAND.findall(render_playbook(pattern))
    assert commands, "the playbook names no run command"
    for command in commands:
        result = run_cli(*command.split(), "--dsn", dsn)
        assert result.returncode == 0, (command, result.stderr)
    assert "migration complete" in result.stdout, result.stdout
