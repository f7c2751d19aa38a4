"""A runner whose live facts cannot be read closes its session (`with` runs no __exit__ when
__enter__ raises): no connection of ours is left behind by a refused command."""

from __future__ import annotations

import time

import psycopg
import pytest

from outbox_migrate.config import load_settings, with_spec
from outbox_migrate.errors import OutboxMigrateError
from outbox_migrate.runner import Runner


def test_a_refused_enter_leaves_no_session_open(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        # A nullable boolean marker with no DEFAULT: its unpublished value cannot be known.
        conn.execute("CREATE TABLE outbox (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
                     "payload json NOT NULL, created_at timestamptz NOT NULL DEFAULT now(), "
                     "sent boolean)")  # fmt: skip
        settings = with_spec(load_settings({}, environ={}), published_column="sent")
        runner = Runner(dsn, settings, "hoper")
        with pytest.raises(OutboxMigrateError):
            runner.__enter__()
        assert runner.session.live is False
        # A closed connection's backend exits a moment after the client hung up: look again
        # for up to five seconds (a session kept open stays, and fails this).
        deadline = time.monotonic() + 5.0
        while True:
            left = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND application_name LIKE 'outbox-migrate%%'"
            ).fetchone()
            if left == (0,) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert left == (0,)
