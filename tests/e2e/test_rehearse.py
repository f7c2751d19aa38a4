"""`outbox-migrate rehearse` end to end: a table unlike the spec's, read by a SELECT-only role
while an application writes to it, rehearsed on a scratch database of the same server.

The source must come out untouched (same rows, same catalog, no update or delete counted by
the statistics, no new relation), the rehearsal must lose nothing, and the report must carry
the measured rates and the extrapolated VALIDATE time.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from outbox_migrate_harness.testing.server import Server
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests.support.cli import run_cli

SOURCE_DDL = """
    CREATE TYPE outbox_kind AS ENUM ('order', 'refund');
    CREATE TABLE outbox (
        id bigserial PRIMARY KEY,
        tenant_id uuid NOT NULL,
        kind outbox_kind NOT NULL,
        event_type text NOT NULL,
        message_key text,
        payload jsonb NOT NULL,
        correlation_id varchar(64),
        attempts int NOT NULL DEFAULT 0 CHECK (attempts >= 0),
        created_at timestamptz NOT NULL DEFAULT now(),
        published_at timestamptz);
    CREATE INDEX outbox_unpublished_id_idx ON outbox (id) WHERE published_at IS NULL;
    CREATE INDEX outbox_tenant_created_idx ON outbox (tenant_id, created_at);
    INSERT INTO outbox (tenant_id, kind, event_type, message_key, payload, published_at)
    SELECT md5(g::text)::uuid, 'order', 'e', 'k' || g % 13, jsonb_build_object('n', g),
           CASE WHEN g % 50 <> 0 THEN now() END
    FROM generate_series(1, 5000) g;
    ANALYZE outbox;
"""
APP_INSERT = (
    "INSERT INTO outbox (tenant_id, kind, event_type, message_key, payload) "
    "VALUES (gen_random_uuid(), 'refund', 'e', 'live', '{}')"
)
READER = "rehearsal_reader"


def _fingerprint(conn: psycopg.Connection[Any], upto: int) -> tuple[Any, ...]:
    """The source's rows up to `upto`, its catalog shape and its write counters."""
    rows = conn.execute(
        "SELECT md5(string_agg(o::text, '|' ORDER BY id)) FROM outbox o WHERE id <= %s", (upto,)
    ).fetchone()
    shape = conn.execute(
        "SELECT string_agg(relname || ':' || relkind::text, ',' ORDER BY relname) FROM pg_class "
        "WHERE relnamespace = 'public'::regnamespace"
    ).fetchone()
    indexes = conn.execute(
        "SELECT string_agg(indexdef, ';' ORDER BY indexname) FROM pg_indexes "
        "WHERE schemaname = 'public'"
    ).fetchone()
    conn.execute("SELECT pg_stat_clear_snapshot()")
    writes = conn.execute(
        "SELECT n_tup_upd, n_tup_del FROM pg_stat_user_tables WHERE relname = 'outbox'"
    ).fetchone()
    return (rows, shape, indexes, writes)


@pytest.fixture
def source(dsn: str) -> Iterator[str]:
    """The source database with the outbox and a SELECT-only login role; its DSN as that role."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in SOURCE_DDL.split(";"):
            if statement.strip():
                conn.execute(statement)
        conn.execute(
            sql.SQL("DROP ROLE IF EXISTS {r}; CREATE ROLE {r} LOGIN").format(
                r=sql.Identifier(READER)
            )
        )
        conn.execute(sql.SQL("GRANT SELECT ON outbox TO {}").format(sql.Identifier(READER)))
    yield make_conninfo(dsn, user=READER)
    with psycopg.connect(dsn, autocommit=True) as conn:
        # The copy carries the source's grants (to this role too): its databases go first.
        for (name,) in conn.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE 'outbox\\_rehearsal\\_%'"
        ).fetchall():
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
        conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(READER)))
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(READER)))


@pytest.mark.pg_edges
@pytest.mark.slow
def test_rehearse_reports_nothing_lost_and_leaves_the_source_untouched(
    pg_server: Server, dsn: str, source: str, tmp_path: Any
) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        top = int(conn.execute("SELECT max(id) FROM outbox").fetchone()[0])  # type: ignore[index]
        before = _fingerprint(conn, top)
    stop = threading.Event()

    def application() -> None:
        with psycopg.connect(dsn, autocommit=True) as app:
            while not stop.wait(0.02):
                app.execute(APP_INSERT)

    writer = threading.Thread(target=application)
    writer.start()
    try:
        result = run_cli(
            "rehearse", "--pattern", "hoper", "--dsn", source, "--scratch-dsn", pg_server.dsn(),
            "--rows", "20000", "--seconds", "12", "--measure-seconds", "3",
            "--output-dir", str(tmp_path), "--format", "json",
            timeout=600,
        )  # fmt: skip
    finally:
        stop.set()
        writer.join()
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["lost"] == 0, report["lost_keys"]
    assert report["produced"] > 100
    assert report["published"] == report["produced"]
    assert report["duplicated"] == 0
    assert report["insert_errors"] == 0, report["insert_error_samples"]
    assert report["relay_errors"] == []
    assert report["scratch"]["rows"] == 20000
    assert report["scratch"]["skipped"] == []
    # The application wrote ~50 rows/s into the source while its rates were measured.
    assert 10 < report["source"]["inserts_per_s"] < 200
    assert report["source"]["row_estimate"] >= 5000
    validate = [e for e in report["extrapolated"] if e["step"].endswith("validate-check")]
    assert validate and validate[0]["estimated_s"] >= 0
    assert any(e["step"] == "copy-back" for e in report["extrapolated"])
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert _fingerprint(conn, top) == before
        # The copy had the source's extra columns, index and enum.
    scratch = make_conninfo(pg_server.dsn(), dbname=report["database"])
    with psycopg.connect(scratch) as conn:
        kinds = conn.execute("SELECT count(*) FROM outbox WHERE kind = 'order'").fetchone()
        assert kinds is not None and kinds[0] > 0
        index = conn.execute(
            "SELECT 1 FROM pg_indexes WHERE indexname = 'outbox_tenant_created_idx'"
        ).fetchone()
        assert index is not None
    assert conninfo_to_dict(source)["user"] == READER


def test_rehearse_refuses_a_scratch_that_is_the_source() -> None:
    result = run_cli(
        "rehearse", "--pattern", "hoper", "--dsn", "host=127.0.0.1 dbname=outbox_rehearsal_0a1b2c3d",
        "--scratch-dsn", "host=127.0.0.1 dbname=postgres",
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "named like a rehearsal's own scratch database" in result.stderr
    assert "Traceback" not in result.stderr


EARLIER = "outbox_rehearsal_e0e0e0e0"
"""An earlier rehearsal's scratch database, as `run_databases` names and marks one."""


def test_a_refused_source_leaves_the_scratch_server_alone(pg_server: Server, dsn: str) -> None:
    """The source is read and judged before the scratch databases are replaced: a wrong
    table name is one line, exit 2, and yesterday's rehearsal database is still there."""
    scratch = make_conninfo(pg_server.dsn(), dbname=EARLIER)
    with psycopg.connect(pg_server.dsn(), autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {EARLIER} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {EARLIER}")
        conn.execute(
            f"COMMENT ON DATABASE {EARLIER} IS "
            "'outbox-migrate outbox_rehearsal run: dropped by a later run once this one has ended'"
        )
    try:
        with psycopg.connect(scratch, autocommit=True) as conn:
            conn.execute("CREATE TABLE kept (n int)")
        result = run_cli(
            "rehearse", "--pattern", "hoper", "--dsn", dsn, "--table", "no_such_outbox",
            "--scratch-dsn", pg_server.dsn(),
        )  # fmt: skip
        assert result.returncode == 2, result.stderr
        assert "no_such_outbox does not exist" in result.stderr
        with psycopg.connect(scratch) as conn:
            assert conn.execute("SELECT to_regclass('kept')").fetchone() == ("kept",)
    finally:
        with psycopg.connect(pg_server.dsn(), autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {EARLIER} WITH (FORCE)")
