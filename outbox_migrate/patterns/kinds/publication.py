"""CDC users migrating: carry the old outbox's publications to the partitioned outbox.

Teams that stream the flat outbox through their own logical-replication consumer (Debezium's
outbox event router and the like) must keep receiving every new message once V2 inserts into
the partitioned table. The step is conditional: it exists only when introspection found a
publication covering the old table, so no other migration's checksums change.

Which relation is published, and why (docs/patterns.md, "CDC consumers"): the **unpublished
partition**, leaf by leaf, with the old table's row filter and column list carried as they
are. Not the parent with `publish_via_partition_root = true`: every publishing mark is a
cross-partition UPDATE, which that shape streams as a DELETE *and a second INSERT of the
parent*, so an insert-driven consumer would emit every message twice; and the option is
publication-wide, so setting it would rename the stream of every other partitioned table in
the user's publication. With the leaf, a mark reaches the stream as a DELETE of the
unpublished partition only (when the publication publishes deletes), never as an insert.

Where: in V2, before the deploy that first writes to the partitioned table, so its first
insert is already in the stream. A publication `FOR ALL TABLES` (or `TABLES IN SCHEMA`)
covers the new tables by itself; for it and for a listed one that publishes UPDATE or
DELETE the step sets `REPLICA IDENTITY FULL` on the partitions it publishes, since without a
replica identity PostgreSQL refuses the relay's mark (and retention's DELETE).

The inverse removes only what this step added: the publication memberships it recorded in
`outbox_migrate.owned_object` (checked by OID before dropping) and the replica identity.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psycopg import sql

from outbox_migrate.lock_budget import LockMode
from outbox_migrate.patterns import conditions as c
from outbox_migrate.patterns.kinds.base import BuildContext, kind
from outbox_migrate.patterns.kinds.partitioned_table import NULL_BOUND
from outbox_migrate.patterns.model import Condition, Created, Lock, PublicationFact, Step
from outbox_migrate.patterns.names import Names

KIND = "publish-unpublished-partition"


def listed(publications: tuple[PublicationFact, ...]) -> tuple[PublicationFact, ...]:
    """Publications that list the old table and do not cover new tables by themselves."""
    return tuple(p for p in publications if p.explicit and not p.covers_new_tables)


def add_table_sql(n: Names, publication: PublicationFact) -> sql.Composed:
    """`ALTER PUBLICATION … ADD TABLE unpublished [(columns)] [WHERE (filter)]`: the row
    filter is the server's own rendering of the old table's filter (`pg_get_expr`), valid
    for the partition because it has the same columns."""
    columns: sql.Composable = sql.SQL("")
    if publication.columns:
        columns = sql.SQL(" ({})").format(
            sql.SQL(", ").join(map(sql.Identifier, publication.columns))
        )
    where: sql.Composable = sql.SQL("")
    if publication.row_filter:
        where = sql.SQL(" WHERE ({})").format(sql.SQL(publication.row_filter))
    return sql.SQL("ALTER PUBLICATION {} ADD TABLE {}{}{}").format(
        sql.Identifier(publication.name), n.q(n.unpublished), columns, where
    )


def _membership(query: str, n: Names, p: PublicationFact, relation: str, label: str) -> Condition:
    return c.condition(query, label, pub_name=sql.Literal(p.name), rel_reg=n.reg(relation))


@kind(KIND)
def publish_unpublished_partition(ctx: BuildContext, params: Mapping[str, Any]) -> Step | None:
    n = ctx.names
    with_published = bool(params.get("published", True))
    adds = listed(ctx.options.publications)
    full_unpublished = any(p.publishes_changes for p in ctx.options.publications)
    full_published = with_published and any(
        p.publishes_changes for p in ctx.options.publications if p.covers_new_tables
    )
    if not adds and not full_unpublished:
        return None
    identity_targets = [n.unpublished] if full_unpublished else []
    if full_published:
        identity_targets.append(n.published)
    statements: list[sql.Composed] = []
    reverse: list[sql.Composed] = []
    preconditions = [c.partition_bound(n, n.unpublished, NULL_BOUND)]
    postcondition: list[Condition] = []
    for p in adds:
        statements.append(add_table_sql(n, p))
        reverse.append(
            sql.SQL("ALTER PUBLICATION {} DROP TABLE {}").format(
                sql.Identifier(p.name), n.q(n.unpublished)
            )
        )
        preconditions += [
            _membership("publication-includes", n, p, n.table, f"{p.name}:old"),
            _membership("publication-excludes", n, p, n.unpublished, p.name),
        ]
        postcondition.append(_membership("publication-includes", n, p, n.unpublished, p.name))
    for rel in identity_targets:
        statements.append(sql.SQL("ALTER TABLE {} REPLICA IDENTITY FULL").format(n.q(rel)))
        reverse.append(sql.SQL("ALTER TABLE {} REPLICA IDENTITY DEFAULT").format(n.q(rel)))
        postcondition.append(c.condition("replica-identity-full", rel, rel_reg=n.reg(rel)))
    names = ", ".join(p.name for p in adds)
    summary = (
        f"Add {n.unpublished} to publication(s) {names} (the old table's CDC stream)"
        if adds
        else f"REPLICA IDENTITY FULL on {' and '.join(identity_targets)} (publications "
        f"{', '.join(p.name for p in ctx.options.publications)} publish UPDATE/DELETE)"
    )
    notes = [
        "Before V2 is deployed, so the first insert into the partitioned table is already in "
        "the stream; the consumer must add the new relation name to its table filter "
        "(see `plan`'s CDC view).",
    ]
    if any(p.row_filter or p.columns for p in adds):
        notes.append("The old table's row filter and column list are carried unchanged.")
    if identity_targets:
        notes.append(
            "REPLICA IDENTITY FULL: each mark's DELETE logs the whole old row to WAL "
            "(without it PostgreSQL refuses the mark under an UPDATE/DELETE publication)."
        )
    return Step(
        **ctx.place(KIND),
        summary=summary,
        statements=tuple(statements),
        # REPLICA IDENTITY takes ACCESS EXCLUSIVE; ADD TABLE SHARE UPDATE EXCLUSIVE. The
        # partitions are empty and unused until V2 is deployed.
        locks=tuple(
            Lock(rel, LockMode.ACCESS_EXCLUSIVE)
            for rel in (n.unpublished, *(r for r in identity_targets if r != n.unpublished))
        ),
        catalog_only=True,
        preconditions=tuple(preconditions),
        postcondition=tuple(postcondition),
        reverse=tuple(reverse),
        reverse_note="remove the partition from the publication(s) it was added to and reset "
        "its replica identity (memberships this migration did not add are left alone)",
        notes=tuple(notes),
        creates=tuple(Created("publication-rel", p.name, on=n.unpublished) for p in adds),
    )
