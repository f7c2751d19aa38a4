"""The optional last phases: the partitioned outbox takes the flat table's original name, a view
under its former name keeps the previous version working, and the view is dropped once no
session uses it (docs/patterns.md, "The final name"). Both renaming kinds restate the whole end
state in their postcondition: earlier steps' postconditions name relations since renamed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from psycopg import sql

from outbox_migrate.config import DEFAULT_CHANNEL
from outbox_migrate.lock_budget import LockMode
from outbox_migrate.patterns import conditions as c
from outbox_migrate.patterns import marker, notify
from outbox_migrate.patterns.kinds.base import BuildContext, kind
from outbox_migrate.patterns.kinds.partitioned_table import DEFAULT_BOUND, NULL_BOUND
from outbox_migrate.patterns.model import CheckPoint, Condition, Created, Lock, Step
from outbox_migrate.patterns.names import Names
from outbox_migrate.patterns.privileges import EVERY_PRIVILEGE, NO_PRIVILEGE, carry_privileges

VIEW_SAMPLE_INTERVAL_S = 0.1
"""How often the drop gate looks at pg_locks for sessions using the view (a transaction held
open across the window is seen; short ones are counted by the rules instead)."""
COUNTED_EVENTS = ("INSERT", "UPDATE", "DELETE")
"""The statements through the view that tick its use counter, one rule each."""


def counting_rule(event: str) -> str:
    """The name of the rule that counts `event` statements (rule names are per relation)."""
    return f"count_{event.lower()}s"


OLD_TABLE_BECOMES = ("published", "retired")
"""`published`: the old table is the DEFAULT partition and takes the published partition's
name; `retired`: it stands alone (COP, HOP) and takes `<table>_retired` (if it still exists)."""


def renamed(n: Names) -> Names:
    """The names after the rename: the parent is called what the flat table was."""
    return Names(replace(n.spec, partitioned_table=n.spec.table))


def view_over(n: Names) -> Condition:
    """The parent's former name is a view over the renamed parent."""
    parts = {"view_reg": n.reg(n.parent), "rel_reg": n.reg(n.table)}
    return c.condition("view-over", n.parent, "original_name", **parts)


def end_state(n: Names) -> tuple[Condition, ...]:
    """The partitioned outbox under the original name, with both of its partitions."""
    after = renamed(n)
    return (
        c.partitioned_by_list(after),
        c.partition_bound(after, after.unpublished, NULL_BOUND),
        c.partition_bound(after, after.published, DEFAULT_BOUND),
    )


def rename_sql(n: Names, relation: str, to: str, *, if_exists: bool = False) -> sql.Composed:
    return sql.SQL("ALTER TABLE {if_exists}{rel} RENAME TO {to}").format(
        if_exists=sql.SQL("IF EXISTS " if if_exists else ""),
        rel=n.q(relation),
        to=sql.Identifier(to),
    )


def create_view_sql(n: Names, *, tableoid: bool = True) -> sql.Composed:
    # `ctid` and `tableoid` by name: a view has no system columns, and a relay started with
    # the former name marks rows by ctid within the relation it claimed them from
    # (relay/queries.py `mark`). `tableoid=False`: the view of earlier releases.
    columns = "ctid, tableoid" if tableoid else "ctid"
    return sql.SQL("CREATE VIEW {view} AS SELECT *, {columns} FROM {table}").format(
        view=n.q(n.parent), columns=sql.SQL(columns), table=n.q(n.table)
    )


def rekey_wake_up_sql(n: Names, key_names: Names) -> sql.Composed:
    """Re-create the wake-up trigger's function (same name, same OID: it stays the migration's
    own) with the idle lock key of `key_names`' partitioned table, if the function exists."""
    body = notify.create_sql(n.spec, DEFAULT_CHANNEL, key_spec=key_names.spec)[0]
    function = sql.Identifier(n.spec.schema, notify.function_name(n.spec)).as_string(None)
    test = sql.SQL("to_regprocedure({}) IS NOT NULL").format(sql.Literal(function + "()"))
    return _execute_if("rekey", test, _text_expression(body.as_string(None)))


def _execute_if(tag: str, test: sql.Composable, statement: sql.Composable) -> sql.Composed:
    """A DO block that executes `statement` (a text expression) only if `test` holds."""
    return sql.SQL(
        "DO ${tag}$\nBEGIN\n"
        "    IF {test} THEN\n"
        "        EXECUTE {statement};\n"
        "    END IF;\n"
        "END\n${tag}$"
    ).format(tag=sql.SQL(tag), test=test, statement=statement)


def _text_expression(text: str) -> sql.Composed:
    """`text` as a PL/pgSQL text expression of one constant per line joined by newlines: a
    multi-line constant cannot be laid out to the width of `plan --format sql` (its lines
    start inside the string), one line per constant can (sql_layout splits a long one)."""
    return sql.SQL(" || chr(10)\n            || ").join(
        sql.Literal(line) for line in text.split("\n")
    )


def seal_sql(n: Names) -> sql.Composed:
    """COP/HOP: seal the standalone flat table (if it is still there) with a NOT VALID CHECK
    that refuses unpublished rows — catalog-only, under the step's lock; dropped first, so a
    rename applied again after its rollback adds it afresh. It stays through the rename's
    rollback (the table then has its name back, and a writer of the original name would
    insert there unseen by any relay); the V3 gate's reverse removes it (`unseal_sql`)."""
    return sql.SQL(
        "ALTER TABLE IF EXISTS {table} DROP CONSTRAINT IF EXISTS {check}, "
        "ADD CONSTRAINT {check} CHECK ({published}) NOT VALID"
    ).format(
        table=n.q(n.table),
        check=sql.Identifier(n.spec.retired_check),
        published=marker.published(n.spec),
    )


def unseal_sql(n: Names) -> sql.Composed:
    """Remove the seal (`seal_sql`) from the flat table if it carries one: going back before
    V3, the old version may insert into it again. Only then is the table locked (ALTER
    TABLE takes ACCESS EXCLUSIVE even for a constraint that is not there), so a rollback of
    a migration that never took the original name does not queue on its busy flat table."""
    drop = sql.SQL("ALTER TABLE {table} DROP CONSTRAINT {check}").format(
        table=n.q(n.table), check=sql.Identifier(n.spec.retired_check)
    )
    test = sql.SQL(
        "EXISTS (SELECT FROM pg_constraint WHERE conrelid = to_regclass({table}) "
        "AND conname = {check})"
    ).format(table=n.reg(n.table), check=sql.Literal(n.spec.retired_check))
    return _execute_if("unseal", test, sql.Literal(drop.as_string(None)))


def carry_grants_sql(n: Names) -> sql.Composed:
    """Give the view the renamed table's owner and every table and column grant: the view runs
    with its owner's rights on the table, so the previous version's role needs on the view
    what it had on the table (`n.table` is by then the renamed partitioned table)."""
    return carry_privileges(n, n.parent, EVERY_PRIVILEGE)


@kind("take-original-name")
def take_original_name(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    n = ctx.names
    becomes = str(params.get("old_table_becomes", "published"))
    if becomes not in OLD_TABLE_BECOMES:
        raise ValueError(
            f"take-original-name: old_table_becomes must be one of {OLD_TABLE_BECOMES}"
        )
    retired = becomes == "retired"
    target = n.spec.retired_table if retired else n.published
    if retired:
        # COP/HOP: the old table stands alone (or was dropped by the operator already).
        old_table_checks: tuple[Condition, ...] = (
            c.partition_bound(n, n.published, DEFAULT_BOUND),
            c.is_plain_table(n, n.table),
            c.not_a_partition(n, n.table),
        )
        moved = (
            f"{n.table} (the retired flat table, if it is still there) is sealed against "
            f"unpublished rows and becomes {target}"
        )
    else:
        old_table_checks = (c.partition_bound(n, n.table, DEFAULT_BOUND),)
        moved = f"{n.table} (the DEFAULT partition) becomes {target}"
    renames = (rename_sql(n, n.table, target, if_exists=retired), rename_sql(n, n.parent, n.table))
    then = (carry_grants_sql(n), rekey_wake_up_sql(n, renamed(n)))
    reverse = (
        sql.SQL("DROP VIEW {}").format(n.q(n.parent)),
        rename_sql(n, n.table, n.parent),
        rename_sql(n, target, n.table, if_exists=retired),
        rekey_wake_up_sql(n, n),
    )
    return Step(
        **ctx.place("take-original-name"),
        summary=f"In one transaction: {moved}, {n.parent} becomes {n.table}, and a view "
        f"{n.parent} over it keeps the previous version's inserts working",
        statements=(*((seal_sql(n),) if retired else ()), *renames, create_view_sql(n), *then),
        # The parent first, as the writers lock it (lock_declared orders it first too); RENAME
        # is catalog-only, so ACCESS EXCLUSIVE is held for milliseconds.
        locks=(Lock(n.parent, LockMode.ACCESS_EXCLUSIVE), Lock(n.table, LockMode.ACCESS_EXCLUSIVE)),
        catalog_only=True,
        optional=True,
        preconditions=(
            c.relation_exists(n, n.parent),
            c.partitioned_by_list(n),
            c.partition_bound(n, n.unpublished, NULL_BOUND),
            c.relation_absent(n, target),
            *old_table_checks,
            # A row no relay reads would be moved aside unpublished with the old table.
            c.no_unread_rows(n, ctx.phase),
        ),
        postcondition=(*end_state(n), view_over(n)),
        reverse=reverse,
        reverse_note=f"drop the view {n.parent}, give {n.table} its name {n.parent} back and "
        f"{target} the name {n.table} — only once no instance of the version that uses "
        f"{n.table} runs: its inserts would reach the old table, which refuses them "
        + ("(sealed by this step's CHECK)" if retired else "(a DEFAULT partition)"),
        reverse_preconditions=(view_over(n),),
        creates=(Created("relation", n.parent),),
        restates_end_state=True,
        notes=(
            f"The previous version keeps inserting into {n.parent} (now a view: INSERTs take "
            f"{n.table}'s defaults and identity); deploy the version that uses {n.table}, then "
            "run the next phase to drop the view.",
            f"A relay started with --partitioned-table {n.parent} keeps publishing (the view "
            f"exposes ctid for its marks); start new relays with --partitioned-table {n.table} "
            f"--table {n.spec.retired_table} (the flat-table option may not name the same "
            "table; partitioned mode does not read it).",
            f"SELECT * through the view {n.parent} returns two more columns, ctid and tableoid.",
        ),
        # Earlier releases' view had no tableoid column (nor did they seal): a rename they did
        # is adopted as done (a relay started with the former name then refuses to mark
        # through it, and says so).
        formerly=((*renames, create_view_sql(n, tableoid=False), *then),),
    )


def count_view_writes_sql(n: Names) -> tuple[sql.Composed, ...]:
    """The view's use counter: a sequence, the function that ticks it, an empty sink table and
    one DO ALSO rule per kind of write, whose action is `INSERT INTO sink SELECT WHERE tick()`.

    Once per statement, and nothing of the statement evaluated twice: a rule's action is
    joined with the statement's own source (a multi-row VALUES, an INSERT's SELECT, an UPDATE's
    scan), but a qual without columns and without volatile functions is a one-time filter,
    evaluated once before anything below it (once per partition an UPDATE or DELETE scans:
    the planner pushes it into each; more ticks only keep the gate shut). So the function is
    declared STABLE although it ticks a sequence, and returns false: the source is never read
    and nothing is inserted.
    It is SECURITY DEFINER with EXECUTE for PUBLIC (a function runs with the caller's rights,
    even in a rule): writers need no grant, and the worst another role can do with it is tick
    the counter, which only keeps the gate shut. The sink is written by the rule as the view's
    owner, so it gets the table's owner and no grant."""
    seq = n.q(n.spec.view_use_sequence)
    sink = n.q(n.spec.view_use_sink)
    function = n.q(n.spec.view_use_function)
    rules = tuple(
        sql.SQL(
            "CREATE RULE {rule} AS ON {event} TO {view} "
            "DO ALSO INSERT INTO {sink} SELECT WHERE {function}()"
        ).format(
            rule=sql.Identifier(counting_rule(event)),
            event=sql.SQL(event),
            view=n.q(n.parent),
            sink=sink,
            function=function,
        )
        for event in COUNTED_EVENTS
    )
    return (
        sql.SQL("CREATE SEQUENCE {} AS bigint CACHE 1").format(seq),
        sql.SQL(
            "CREATE FUNCTION {function}() RETURNS boolean LANGUAGE plpgsql STABLE "
            "SECURITY DEFINER SET search_path = pg_catalog AS $om$\n"
            "BEGIN\n"
            "    PERFORM nextval({seq_reg}::regclass);\n"
            "    RETURN false;\n"
            "END\n"
            "$om$"
        ).format(function=function, seq_reg=n.reg(n.spec.view_use_sequence)),
        sql.SQL("GRANT EXECUTE ON FUNCTION {}() TO PUBLIC").format(function),
        sql.SQL("CREATE TABLE {} ()").format(sink),
        carry_privileges(n, n.spec.view_use_sink, NO_PRIVILEGE),
        *rules,
    )


def drop_view_counter_sql(n: Names) -> tuple[sql.Composed, ...]:
    """The counter's sink, function and sequence (the rules go with the view, or first)."""
    return (
        sql.SQL("DROP TABLE {}").format(n.q(n.spec.view_use_sink)),
        sql.SQL("DROP FUNCTION {}()").format(n.q(n.spec.view_use_function)),
        sql.SQL("DROP SEQUENCE {}").format(n.q(n.spec.view_use_sequence)),
    )


def view_writes_counted(n: Names) -> Condition:
    return c.condition(
        "view-writes-counted",
        n.parent,
        "original_name",
        view_reg=n.reg(n.parent),
        seq_reg=n.reg(n.spec.view_use_sequence),
        rules=sql.SQL("ARRAY[{}]::name[]").format(
            sql.SQL(", ").join(sql.Literal(counting_rule(e)) for e in COUNTED_EVENTS)
        ),
    )


def counter_absent(n: Names) -> tuple[Condition, ...]:
    return (
        c.relation_absent(n, n.spec.view_use_sequence),
        c.function_absent(n, n.spec.view_use_function),
        c.relation_absent(n, n.spec.view_use_sink),
    )


def _counter_created(n: Names) -> tuple[Created, ...]:
    return (
        Created("relation", n.spec.view_use_sequence),
        Created("function", n.spec.view_use_function),
        Created("relation", n.spec.view_use_sink),
    )


@kind("count-view-writes")
def count_view_writes(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    n = ctx.names
    return Step(
        **ctx.place("count-view-writes"),
        summary=f"Count every write through the view {n.parent}: rules tick "
        f"{n.spec.view_use_sequence} once per statement, the drop gate's evidence",
        statements=count_view_writes_sql(n),
        # CREATE RULE takes ACCESS EXCLUSIVE on the view: catalog-only, held for milliseconds.
        locks=(Lock(n.parent, LockMode.ACCESS_EXCLUSIVE),),
        catalog_only=True,
        optional=True,
        preconditions=(
            view_over(n),
            *counter_absent(n),
        ),
        postcondition=(view_over(n), view_writes_counted(n)),
        reverse=(
            *(
                sql.SQL("DROP RULE {} ON {}").format(
                    sql.Identifier(counting_rule(e)), n.q(n.parent)
                )
                for e in COUNTED_EVENTS
            ),
            *drop_view_counter_sql(n),
        ),
        reverse_note=f"drop the counting rules on {n.parent}, {n.spec.view_use_sink} and "
        f"{n.spec.view_use_sequence}",
        reverse_preconditions=(view_over(n),),
        creates=_counter_created(n),
        notes=(
            "Writers of the previous version need no new grant: the counting function is "
            "SECURITY DEFINER, executable by PUBLIC; the empty sink is written by the view's "
            "owner. RETURNING and ON CONFLICT through the view work as before.",
        ),
    )


@kind("drop-compat-view")
def drop_compat_view(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    """The gate compares the view's use counter across its window and again under the step's
    lock, and watches `pg_locks` for a transaction that used the view and is still open."""
    n = ctx.names
    samples = max(1, round(ctx.options.sample_window_s / VIEW_SAMPLE_INTERVAL_S))
    counter = {
        "view_reg": n.reg(n.parent),
        "seq_reg": n.reg(n.spec.view_use_sequence),
        "phase": sql.Literal(ctx.phase),
        "sample_key": c.sample_key(n, n.spec.view_use_sequence, "view"),
    }
    unused = c.condition(
        "no-view-users",
        n.parent,
        "original_name",
        samples=sql.Literal(samples),
        interval_s=sql.Literal(VIEW_SAMPLE_INTERVAL_S),
        window_s=sql.Literal(ctx.options.sample_window_s),
        **counter,
    )
    sampled = c.before_lock(
        unused,
        CheckPoint.SAMPLED,
        f"no-view-writes-since-sample:{n.parent} (under the lock); a writer of the previous "
        "version that comes back after the drop gets an error",
    )
    gate: list[Condition] = [
        view_over(n),
        sampled,
        c.condition("no-view-writes-since-sample", n.parent, "original_name", **counter),
    ]
    if ctx.options.old_app_name:
        gate.append(c.no_old_app_sessions(ctx.options.old_app_name, ctx.phase))
    recreate = (create_view_sql(n), carry_grants_sql(n), *count_view_writes_sql(n))
    return Step(
        **ctx.place("drop-compat-view"),
        summary=f"Gate and drop: no write went through the view {n.parent} during the window "
        "and nobody holds it; drop it and its use counter",
        statements=(sql.SQL("DROP VIEW {}").format(n.q(n.parent)), *drop_view_counter_sql(n)),
        locks=(Lock(n.parent, LockMode.ACCESS_EXCLUSIVE),),
        catalog_only=True,
        optional=True,
        preconditions=tuple(gate),
        postcondition=(
            *end_state(n),
            c.relation_absent(n, n.parent),
            *counter_absent(n),
        ),
        reverse=recreate,
        reverse_note=f"re-create the view {n.parent} over {n.table} with its grants and its "
        "use counter",
        reverse_preconditions=(c.relation_absent(n, n.parent), *counter_absent(n)),
        reverse_creates=(Created("relation", n.parent), *_counter_created(n)),
        restates_end_state=True,
    )
