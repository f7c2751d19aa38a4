"""REINDEX CONCURRENTLY's old-transaction guard run as the table's owner, against a
transaction of the application's role whose start PostgreSQL hides from the owner.

Before, the guard read `xact_start` (NULL for another role) and saw nothing, so the rebuild
started and then waited for that transaction until its lock timeout. Now a hidden transaction
that stays open is counted, and the refusal names the grant that would show its age.
"""

from __future__ import annotations

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_partitioned_outbox, insert_rows

from outbox_migrate.errors import ReindexRefused
from outbox_migrate.jobs import reindex
from outbox_migrate.jobs.common import Relation
from tests.support.roles import DocumentedRoles

UNPUBLISHED = Relation("public", "outbox_unpublished")
INDEX = "outbox_new_unpublished_id_idx"


@pytest.mark.newest_pg_only
def test_a_hidden_open_transaction_refuses_the_reindex_with_the_grant(
    dsn: str, roles: DocumentedRoles
) -> None:
    with psycopg.connect(roles.owner_dsn, autocommit=True) as owner:
        create_partitioned_outbox(owner)
        insert_rows(owner, "outbox_new", 100)
        roles.grant("SELECT", "outbox_new", roles.app)
        with psycopg.connect(roles.app_dsn, application_name="long-report") as app:
            app.execute("SELECT count(*) FROM outbox_new").fetchone()  # transaction open
            with pytest.raises(ReindexRefused, match="whose age is hidden") as refused:
                reindex.reindex_concurrently(owner, UNPUBLISHED, INDEX, lock_timeout_ms=1_000)
            message = str(refused.value)
            assert f"pid {app.info.backend_pid} (long-report)" in message
            assert f"GRANT pg_read_all_stats TO {roles.owner}" in message
        assert reindex.leftover_indexes(owner, UNPUBLISHED) == []
        # Nobody left: it rebuilds.
        assert reindex.reindex_concurrently(owner, UNPUBLISHED, INDEX).seconds >= 0
