"""A runner that ends gives its per-table lock back before it closes its session.

Found in CI: an operator's next command, started the moment the last one returned, was refused
with "another runner is migrating" naming the last one's pid. Closing a connection only sends
libpq's Terminate; the server process ends (and its session locks go) a moment later, and on a
loaded machine that moment is long enough for the next runner's `pg_try_advisory_lock` to lose.
"""

from __future__ import annotations

import time

import psycopg
from outbox_migrate_harness.testing.schema import create_flat_outbox

from outbox_migrate.config import load_settings
from outbox_migrate.runner import Runner
from outbox_migrate.runner.session import runner_lock_key


def test_the_lock_is_free_while_the_ended_runners_server_process_is_still_ending(dsn: str) -> None:
    """The server process of the runner that ended is held in its exit (a temporary table it
    must drop at exit, locked by another session), as a loaded server holds it for a moment:
    the next runner must find the lock free all the same."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
    settings = load_settings({}, environ={})
    key = runner_lock_key("public.outbox")
    with (
        psycopg.connect(dsn, autocommit=True) as next_runner,
        psycopg.connect(dsn) as holder,
    ):
        with Runner(dsn, settings, "hoper") as runner:
            runner.acquire()
            pid = runner.conn.info.backend_pid
            with runner.conn.transaction():
                runner.conn.execute("CREATE TEMPORARY TABLE slow_exit (n int)")
                row = runner.conn.execute(
                    "SELECT nspname FROM pg_namespace WHERE oid = pg_my_temp_schema()"
                ).fetchone()
            assert row is not None
            holder.execute(f'LOCK TABLE "{row[0]}".slow_exit IN ACCESS SHARE MODE')
        try:
            # The ended runner's server process is still there, stuck in its exit.
            time.sleep(0.2)
            alive = next_runner.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)
            ).fetchone()
            assert alive == (1,)
            got = next_runner.execute("SELECT pg_try_advisory_lock(%s, %s)", key).fetchone()
        finally:
            holder.rollback()
        assert got == (True,), "the next runner was refused: the lock went only with the process"
