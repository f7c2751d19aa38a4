"""CDC users migrating: carry the old outbox's publications to the partitioned outbox.

The step exists only when introspection found a publication covering the old table, so no
other migration's checksums change; why the unpublished partition and not the parent is in
docs/patterns.md ("CDC consumers").
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
