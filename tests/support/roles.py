"""The roles the docs name, on a test server: the table's owner (who runs the migration), the
application and the relay — login roles that are not superusers and hold no monitoring role.

PostgreSQL shows another role's session activity (`backend_type`, `state`, `xact_start`,
`query`) only to members of that role or of `pg_read_all_stats`; a check proven as a superuser
proves nothing about these roles, so the gates and guards are tested as them too. Names are
unique per instance (roles are cluster-wide); `drop` ends their sessions and removes them.
"""

from __future__ import annotations

import uuid

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo


class DocumentedRoles:
    """`owner`, `app` and `relay` login roles and a DSN for each on the test's database."""

    def __init__(self, dsn: str) -> None:
        suffix = uuid.uuid4().hex[:8]
        self.dsn = dsn
        self.owner, self.app, self.relay = (
            f"om_owner_{suffix}",
            f"om_app_{suffix}",
            f"om_relay_{suffix}",
        )
        self.owner_dsn = make_conninfo(dsn, user=self.owner)
        self.app_dsn = make_conninfo(dsn, user=self.app)
        self.relay_dsn = make_conninfo(dsn, user=self.relay)
        with psycopg.connect(dsn, autocommit=True) as admin:
            database = sql.Identifier(admin.info.dbname)
            for role in (self.owner, self.app, self.relay):
                admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
                admin.execute(
                    sql.SQL("GRANT USAGE ON SCHEMA public TO {}").format(sql.Identifier(role))
                )
            owner = sql.Identifier(self.owner)
            admin.execute(sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(database, owner))
            admin.execute(sql.SQL("GRANT CREATE ON SCHEMA public TO {}").format(owner))

    def grant(self, privileges: str, table: str, role: str) -> None:
        """`GRANT <privileges> ON <table> TO <role>`, as the owner (who owns the table)."""
        with psycopg.connect(self.owner_dsn, autocommit=True) as owner:
            owner.execute(
                sql.SQL("GRANT {} ON {} TO {}").format(
                    sql.SQL(privileges), sql.Identifier(table), sql.Identifier(role)
                )
            )

    def grant_stats(self, role: str) -> None:
        """What the refusals ask for: `GRANT pg_read_all_stats TO <role>`."""
        with psycopg.connect(self.dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("GRANT pg_read_all_stats TO {}").format(sql.Identifier(role)))

    def drop(self) -> None:
        roles = (self.app, self.relay, self.owner)
        with psycopg.connect(self.dsn, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE usename = ANY(%s) AND pid <> pg_backend_pid()",
                (list(roles),),
            )
            for role in roles:
                ident = sql.Identifier(role)
                admin.execute(sql.SQL("DROP OWNED BY {} CASCADE").format(ident))
                admin.execute(sql.SQL("DROP ROLE {}").format(ident))
