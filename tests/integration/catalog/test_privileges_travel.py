"""Privileges travel with the table: every relation the migration creates gets the old
table's owner and the grants the application uses, in the transaction that creates it —
through the runner, through `plan --sql` applied with psql, and as `plan` shows them.

Found in the field: `run --to V2` created the partitioned outbox with no grants, so a
least-privilege V2 failed with "permission denied for table outbox_new".
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox
from outbox_migrate_harness.testing.server import Server
from psycopg import sql

from outbox_migrate.advisory.introspect import introspect
from outbox_migrate.config import OutboxSpec, load_settings
from outbox_migrate.errors import PreconditionFailed, SchemaError
from outbox_migrate.patterns import BuildOptions, build_pattern
from outbox_migrate.plan import render_sql, split_sql_phases
from outbox_migrate.runner import Runner

SPEC = OutboxSpec()
NEW_TABLES = ("outbox_new", "outbox_unpublished", "outbox_published")


class Roles:
    """An owner role (not a superuser), the application and a column-level reader."""

    def __init__(self, conn: psycopg.Connection) -> None:
        suffix = uuid.uuid4().hex[:8]
        self.conn = conn
        self.owner, self.app, self.reader = (f"om_{r}_{suffix}" for r in ("own", "app", "rd"))
        for role in (self.owner, self.app, self.reader):
            conn.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(role)))
        conn.execute(sql.SQL("GRANT CREATE, USAGE ON SCHEMA public TO {}").format(self.ident()))

    def ident(self, which: str = "owner") -> sql.Identifier:
        return sql.Identifier(getattr(self, which))

    def drop(self) -> None:
        for role in (self.app, self.reader, self.owner):
            self.conn.execute(sql.SQL("DROP OWNED BY {} CASCADE").format(sql.Identifier(role)))
            self.conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


@pytest.fixture
def roles(conn: psycopg.Connection) -> Iterator[Roles]:
    """The old table, owned by `owner`; the app may SELECT, INSERT, UPDATE; the reader may
    SELECT two columns; PUBLIC may SELECT."""
    made = Roles(conn)
    try:
        create_flat_outbox(conn, SPEC)
        conn.execute(sql.SQL("ALTER TABLE outbox OWNER TO {}").format(made.ident()))
        conn.execute(
            sql.SQL("GRANT SELECT, INSERT, UPDATE ON outbox TO {}").format(made.ident("app"))
        )
        conn.execute(
            sql.SQL("GRANT SELECT (id, payload) ON outbox TO {}").format(made.ident("reader"))
        )
        yield made
    finally:
        made.drop()


def acl(conn: psycopg.Connection, table: str) -> set[tuple[str, str, str | None]]:
    """(grantee, privilege, column) of every table and column grant on `table`."""
    rows = conn.execute(
        "SELECT grantee::regrole::text, privilege_type, NULL FROM pg_class c, "
        "aclexplode(c.relacl) a WHERE c.oid = %(t)s::regclass AND grantee <> c.relowner "
        "UNION ALL SELECT grantee::regrole::text, privilege_type, attname FROM pg_attribute t, "
        "aclexplode(t.attacl) a WHERE t.attrelid = %(t)s::regclass",
        {"t": table},
    ).fetchall()
    return {(r[0], r[1], r[2]) for r in rows}


def owners(conn: psycopg.Connection) -> set[str]:
    rows = conn.execute(
        "SELECT relowner::regrole::text FROM pg_class WHERE relname = ANY(%s)", (list(NEW_TABLES),)
    ).fetchall()
    assert len(rows) == len(NEW_TABLES)
    return {r[0] for r in rows}


def assert_carried(conn: psycopg.Connection, roles: Roles) -> None:
    app = {(roles.app, p, None) for p in ("SELECT", "INSERT", "UPDATE")}
    reader = {(roles.reader, "SELECT", "id"), (roles.reader, "SELECT", "payload")}
    assert acl(conn, "outbox_new") == app | reader
    # The relay claims from the unpublished partition directly (and deletes a dead-lettered
    # row that cannot be marked: the role that marks gets DELETE); nothing else reads either.
    assert acl(conn, "outbox_unpublished") == {
        (roles.app, "SELECT", None), (roles.app, "UPDATE", None), (roles.app, "DELETE", None),
        *reader,
    }  # fmt: skip
    assert acl(conn, "outbox_published") == set()
    assert owners(conn) == {roles.owner}
    # The dead-letter tables: the relay's role (it marks: UPDATE) writes them; the reader not.
    relay = {(roles.app, p, None) for p in ("SELECT", "INSERT", "UPDATE", "DELETE")}
    for table in ("outbox_dead_letter", "outbox_dead_letter_attempts"):
        assert acl(conn, table) == relay, table
        owner = conn.execute(
            "SELECT relowner::regrole::text FROM pg_class WHERE oid = %s::regclass", (table,)
        ).fetchone()
        assert owner == (roles.owner,), table


def test_the_runner_gives_new_tables_the_old_owner_and_grants(
    dsn: str, conn: psycopg.Connection, roles: Roles
) -> None:
    """The migration runs as a superuser; the tables still end up the application owner's."""
    settings = load_settings({"gate_window_s": 0.1}, environ={})
    with Runner(dsn, settings, "hoper") as runner:
        runner.run("V2")
    assert_carried(conn, roles)


def test_plan_sql_applied_with_psql_carries_them_too(
    pg_server: Server, dsn: str, conn: psycopg.Connection, roles: Roles
) -> None:
    built = build_pattern("hop", SPEC, BuildOptions(sample_window_s=0.1))
    v2 = split_sql_phases(render_sql(built, SPEC))["V2"]
    result = subprocess.run(
        [pg_server.tool("psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", dsn, "-f", "-"],
        input=v2, capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert_carried(conn, roles)


def test_plan_shows_the_grants_and_the_revoke_the_switch_waits_for(
    conn: psycopg.Connection, roles: Roles
) -> None:
    facts = introspect(conn, SPEC, "hoper")
    shown = {(o.kind, o.name): o for o in facts.objects}
    assert shown[("owner", roles.owner)].fate.startswith("owns outbox_new and its partitions")
    app = shown[("grant", roles.app)]
    assert app.definition == "INSERT, SELECT, UPDATE"
    assert app.fate.startswith("INSERT, SELECT, UPDATE: granted on outbox_new")
    assert "SELECT, UPDATE also on outbox_unpublished" in app.fate
    assert "DELETE on outbox_unpublished and SELECT, INSERT, UPDATE, DELETE on " in app.fate
    assert "outbox_dead_letter_attempts (the relay's dead letters)" in app.fate
    revoke = f'REVOKE INSERT ON "public"."outbox" FROM {roles.app}'
    assert app.fate.endswith(revoke)
    conn.execute(revoke)  # the advice runs as printed
    assert conn.execute(
        "SELECT has_table_privilege(%s, 'outbox', 'INSERT')", (roles.app,)
    ).fetchone() == (False,)
    assert shown[("grant", roles.reader)].definition == "SELECT (id), SELECT (payload)"
    assert "REVOKE" not in shown[("grant", roles.reader)].fate


def test_row_level_security_is_refused_with_a_reason(
    dsn: str, conn: psycopg.Connection, roles: Roles
) -> None:
    conn.execute("ALTER TABLE outbox ENABLE ROW LEVEL SECURITY")
    conn.execute("CREATE POLICY tenant ON outbox USING (true)")
    facts = introspect(conn, SPEC, "hop")
    assert [b.code for b in facts.blockers] == ["row-security"]
    settings = load_settings({"gate_window_s": 0.1}, environ={})
    with Runner(dsn, settings, "hop") as runner, pytest.raises(SchemaError) as refused:
        runner.run("V2")  # admission refuses what plan calls a blocker
    assert "DISABLE ROW LEVEL SECURITY" in str(refused.value)
    # Offline SQL has no admission: the step's own precondition refuses it there.
    create = build_pattern("hop").phase("V2").steps[0]
    check = next(c for c in create.preconditions if c.name.startswith("no-row-security"))
    violations = conn.execute(check.query).fetchall()
    assert len(violations) == 1 and "DISABLE ROW LEVEL SECURITY" in violations[0][0]
    assert conn.execute("SELECT to_regclass('outbox_new')").fetchone() == (None,)


def test_a_migration_role_that_cannot_give_the_tables_away_is_refused(
    dsn: str, conn: psycopg.Connection, roles: Roles
) -> None:
    """Run as a role that is neither the owner nor a member of it: refused before anything
    is created, not half-way with tables the application cannot use."""
    other = f"om_other_{uuid.uuid4().hex[:8]}"
    ident = sql.Identifier(other)
    conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(ident))
    conn.execute(sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(
        sql.Identifier(conn.info.dbname), ident))  # fmt: skip
    conn.execute(sql.SQL("GRANT CREATE, USAGE ON SCHEMA public TO {}").format(ident))
    conn.execute(sql.SQL("GRANT SELECT ON outbox TO {}").format(ident))
    # Before PostgreSQL 18, reading the id sequence's position needs a privilege on it.
    conn.execute(sql.SQL("GRANT SELECT ON SEQUENCE outbox_id_seq TO {}").format(ident))
    try:
        settings = load_settings({"gate_window_s": 0.1}, environ={})
        with (
            Runner(psycopg.conninfo.make_conninfo(dsn, user=other), settings, "hop") as runner,
            pytest.raises(PreconditionFailed) as refused,
        ):
            runner.run("V2")
        assert "may-give-to-owner" in refused.value.condition
        assert conn.execute("SELECT to_regclass('outbox_new')").fetchone() == (None,)
    finally:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (other,)
        )
        conn.execute(sql.SQL("DROP OWNED BY {} CASCADE").format(ident))
        conn.execute(sql.SQL("DROP ROLE {}").format(ident))


def test_an_owner_that_may_not_create_in_the_schema_is_refused_up_front(
    dsn: str, conn: psycopg.Connection, roles: Roles
) -> None:
    """The migration runs as a member of the owner role, but the owner may not create in the
    schema (ALTER TABLE … OWNER TO demands it): refused before anything is created, with the
    GRANT that fixes it, instead of failing inside the step."""
    member = f"om_member_{uuid.uuid4().hex[:8]}"
    ident = sql.Identifier(member)
    conn.execute(sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(ident, roles.ident()))
    conn.execute(sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(
        sql.Identifier(conn.info.dbname), ident))  # fmt: skip
    conn.execute(sql.SQL("GRANT CREATE, USAGE ON SCHEMA public TO {}").format(ident))
    conn.execute(sql.SQL("REVOKE CREATE ON SCHEMA public FROM {}").format(roles.ident()))
    conn.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")  # granted before PostgreSQL 15
    try:
        settings = load_settings({"gate_window_s": 0.1}, environ={})
        with (
            Runner(psycopg.conninfo.make_conninfo(dsn, user=member), settings, "hop") as runner,
            pytest.raises(PreconditionFailed) as refused,
        ):
            runner.run("V2")
        assert "may-give-to-owner" in refused.value.condition
        assert f"GRANT CREATE ON SCHEMA public TO {roles.owner}" in refused.value.observed
        assert conn.execute("SELECT to_regclass('outbox_new')").fetchone() == (None,)
    finally:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (member,)
        )
        conn.execute(sql.SQL("DROP OWNED BY {} CASCADE").format(ident))
        conn.execute(sql.SQL("DROP ROLE {}").format(ident))
