"""HOPER's copy-back as the docs run it: the runner is the table's owner, not a superuser.

The job reads the published partition, inserts into the old table (the DEFAULT partition after
the swap), records its progress in the ledger schema and drops what it copied from — every one
of those needs only what the owner has; a privilege only a superuser holds would show here as
a refusal, not in a test run as `postgres`.
"""

from __future__ import annotations

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox

from tests.support.cli import run_cli
from tests.support.roles import DocumentedRoles

PUBLISHED_MEANWHILE = 50
"""Rows the new version writes and publishes between V2 and the swap: what copy-back moves."""


@pytest.mark.newest_pg_only
def test_copy_back_as_the_owner_keeps_every_row(roles: DocumentedRoles) -> None:
    with psycopg.connect(roles.owner_dsn, autocommit=True) as owner:
        create_flat_outbox(owner)
        owner.execute(
            "INSERT INTO outbox (event_type, message_key, payload, published_at) "
            "SELECT 'e', 'old-' || n, '{}', now() FROM generate_series(1, 200) n"
        )
        ran = run_cli("run", "--to", "V2", "--pattern", "hoper", "--dsn", roles.owner_dsn)
        assert ran.returncode == 0, ran.stderr
        owner.execute(
            "INSERT INTO outbox_new (event_type, message_key, payload) "
            "SELECT 'e', 'new-' || n, '{}' FROM generate_series(1, %s) n",
            (PUBLISHED_MEANWHILE,),
        )
        owner.execute("UPDATE outbox_new SET published_at = now() WHERE published_at IS NULL")
        for phase in ("V3", "V4", "copy-back"):
            ran = run_cli("run", "--to", phase, "--pattern", "hoper", "--dsn", roles.owner_dsn)
            assert ran.returncode == 0, (phase, ran.stderr)
        assert "migration complete" in ran.stdout, ran.stdout
        keys = {key for (key,) in owner.execute("SELECT message_key FROM outbox_new").fetchall()}
    assert {f"old-{n}" for n in range(1, 201)} <= keys
    assert {f"new-{n}" for n in range(1, PUBLISHED_MEANWHILE + 1)} <= keys
    assert len(keys) == 200 + PUBLISHED_MEANWHILE
