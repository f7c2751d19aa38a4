"""The catalog as data: ids, phases and step lists against the spec, completeness of every
step's description, checksums, and identifier quoting. No database."""

from __future__ import annotations

import dataclasses

import pytest
from psycopg import sql

from outbox_migrate.config import OutboxSpec
from outbox_migrate.errors import UsageError
from outbox_migrate.lock_budget import LockMode
from outbox_migrate.offline import assertion, step_sql
from outbox_migrate.patterns import PATTERN_NAMES, BuildOptions, build_pattern
from outbox_migrate.patterns.kinds import load_all
from outbox_migrate.patterns.model import Pattern, PhaseKind, PublicationFact, Step, Table, TxMode
from outbox_migrate.wizard import Answers, recommend

ALL = BuildOptions(include_optional=True)
OLD, NEW, SWITCH = Table.OLD, Table.NEW, Table.OLD_THEN_NEW

# The optional last phases of every pattern: the partitioned table takes the original name.
ORIGINAL_NAME = [("original-name", NEW, NEW), ("drop-view", NEW, NEW)]
OPTIONAL_PHASES = {"original-name", "drop-view"}
# (phase, inserts into, publishes from) exactly as the spec lists the deploys of each pattern.
SPEC_PHASES = {
    "cop": [("V1", OLD, OLD), ("V2", NEW, OLD), ("V3", NEW, NEW), *ORIGINAL_NAME],
    "copra": [
        ("V1", OLD, OLD),
        ("V2", NEW, OLD),
        ("V3", NEW, OLD),
        ("V4", NEW, NEW),
        *ORIGINAL_NAME,
    ],
    "hop": [("V1", OLD, OLD), ("V2", NEW, SWITCH), ("V3", NEW, NEW), *ORIGINAL_NAME],
    "hoper": [
        ("V1", OLD, OLD),
        ("V2", NEW, SWITCH),
        ("V3", NEW, NEW),
        ("V4", NEW, NEW),
        ("copy-back", NEW, NEW),
        *ORIGINAL_NAME,
    ],
    "hopia": [
        ("V1", OLD, OLD),
        ("V2", NEW, SWITCH),
        ("V3", NEW, NEW),
        ("V4", NEW, NEW),
        *ORIGINAL_NAME,
    ],
}

CREATE = [
    "create-partitioned-table",
    "create-unpublished-partition",
    "create-dead-letter-tables",
    "grant-dead-letters",
    "create-unpublished-index",
    "guard-unpublished",
    "install-notify-trigger",
    "create-published-partition",
    "tune-autovacuum",
    "install-gate-sequence",
]
ORIGINAL_NAME_KINDS = {
    "original-name": ["take-original-name"],
    "drop-view": ["count-view-writes", "drop-compat-view"],
}
CHECK_SEQUENCE = [
    "drop-identity",
    "add-not-valid-check",
    "remove-gate-sequence",
    "validate-check",
    "set-not-null",
]
RETIRED = ["gate-old-table-retired", "remove-gate-sequence"]
# The kinds of each phase, with optional steps included.
SPEC_KINDS = {
    "cop": {"V1": [], "V2": CREATE, "V3": RETIRED, **ORIGINAL_NAME_KINDS},
    "copra": {
        "V1": [],
        # No published partition: the old table becomes it in V3.
        "V2": [*CREATE[:7], "install-gate-sequence"],
        "V3": [
            "gate-old-table-retired",
            *CHECK_SEQUENCE,
            "disable-old-triggers",
            "attach-old-as-default",
            "drop-check",
            "tune-autovacuum-old",
        ],
        "V4": [],
        **ORIGINAL_NAME_KINDS,
    },
    "hop": {"V1": [], "V2": CREATE, "V3": RETIRED, **ORIGINAL_NAME_KINDS},
    "hoper": {
        "V1": [],
        "V2": CREATE,
        "V3": ["gate-old-table-retired"],
        "V4": [
            *CHECK_SEQUENCE,
            "disable-old-triggers",
            "swap-default",
            "drop-check",
            "tune-autovacuum-old",
        ],
        "copy-back": ["copy-back", "drop-published"],
        **ORIGINAL_NAME_KINDS,
    },
    "hopia": {
        "V1": [],
        "V2": [*CREATE[:-1], "install-copy-trigger", "install-gate-sequence"],
        "V3": ["gate-old-table-retired"],
        "V4": [
            *CHECK_SEQUENCE,
            "disable-old-triggers",
            "swap-default",
            "drop-check",
            "remove-copy-trigger",
            "tune-autovacuum-old",
            "drop-detached-published",
        ],
        **ORIGINAL_NAME_KINDS,
    },
}


def test_unpublished_guard_off_builds_no_guard_and_nothing_else_changes() -> None:
    """`unpublished_guard = false`: no guard step anywhere, every other step as it was."""
    unguarded = OutboxSpec(unpublished_guard=False)
    for name in PATTERN_NAMES:
        guarded = [s for s in build_pattern(name, OutboxSpec(), ALL).steps()]
        without = [s.checksum() for s in build_pattern(name, unguarded, ALL).steps()]
        assert [s.checksum() for s in guarded if s.kind != "guard-unpublished"] == without
        assert [s.kind for s in guarded].count("guard-unpublished") == 1


def every_pattern(options: BuildOptions = ALL) -> list[Pattern]:
    return [build_pattern(name, OutboxSpec(), options) for name in PATTERN_NAMES]


APPLICATION_IDS = OutboxSpec(id_kind="application", order_column="created_at")


PUBLISHED = dataclasses.replace(ALL, publications=(PublicationFact("dbz"),))
"""A flat outbox in a FOR TABLE publication (CDC users): the conditional step appears."""


def every_step() -> list[tuple[Pattern, Step]]:
    """Every step of every pattern, and the steps only application ids have (the gate
    sequence's) or only a published outbox has (the CDC step)."""
    steps = [(p, s) for p in every_pattern() for s in p.steps()]
    known = {s.id for _, s in steps}
    application = [build_pattern(name, APPLICATION_IDS, ALL) for name in PATTERN_NAMES]
    published = every_pattern(PUBLISHED)
    extra = [(p, s) for p in [*application, *published] for s in p.steps() if s.id not in known]
    return steps + list({s.id: (p, s) for p, s in extra}.values())


@pytest.mark.parametrize("name", PATTERN_NAMES)
def test_phases_and_application_behaviour_follow_the_spec(name: str) -> None:
    pattern = build_pattern(name, options=ALL)
    observed = [(p.name, p.app.inserts_into, p.app.publishes_from) for p in pattern.phases]
    assert observed == SPEC_PHASES[name]
    kinds = [p.kind for p in pattern.phases]
    jobs = ("copy-back", "drop-view")
    expected = [PhaseKind.JOB if p in jobs else PhaseKind.DEPLOY for p, *_ in observed]
    assert kinds == expected


@pytest.mark.parametrize("name", PATTERN_NAMES)
def test_step_kinds_per_phase_follow_the_spec(name: str) -> None:
    pattern = build_pattern(name, options=ALL)
    assert {p.name: [s.kind for s in p.steps] for p in pattern.phases} == SPEC_KINDS[name]


def test_optional_steps_are_left_out_by_default() -> None:
    for full, default in zip(every_pattern(), every_pattern(BuildOptions()), strict=True):
        dropped = {s.id for s in full.steps()} - {s.id for s in default.steps()}
        assert dropped == {s.id for s in full.steps() if s.optional}
    optional = {s.id for _, s in every_step() if s.optional}
    assert optional == {
        "copra.v3.set-not-null",
        "hoper.v4.set-not-null",
        "hopia.v4.set-not-null",
        "hopia.v4.drop-detached-published",
        "copra.v3.disable-old-triggers",
        "hoper.v4.disable-old-triggers",
        "hopia.v4.disable-old-triggers",
        *(f"{name}.original-name.take-original-name" for name in PATTERN_NAMES),
        *(f"{name}.drop-view.count-view-writes" for name in PATTERN_NAMES),
        *(f"{name}.drop-view.drop-compat-view" for name in PATTERN_NAMES),
    }


def test_original_name_phases_are_left_out_whole_by_default() -> None:
    """Without --with-optional the pattern is what it was: no empty optional phase either
    (plans, playbooks and Alembic revisions of existing migrations stay unchanged)."""
    for full, default in zip(every_pattern(), every_pattern(BuildOptions()), strict=True):
        assert [p.name for p in full.phases if p.name in OPTIONAL_PHASES] == [
            "original-name",
            "drop-view",
        ]
        assert OPTIONAL_PHASES.isdisjoint(default.phase_names())
        assert default.phase_names() == [p for p in full.phase_names() if p not in OPTIONAL_PHASES]


def test_step_ids_are_pattern_phase_kind_and_unique() -> None:
    ids = []
    for pattern, step in every_step():
        assert step.id == f"{pattern.name}.{step.phase.lower()}.{step.kind}"
        ids.append(step.id)
    assert len(ids) == len(set(ids))


def test_step_ids_do_not_depend_on_the_names_in_the_spec() -> None:
    custom = OutboxSpec(schema="billing", table="events", partitioned_table="events_p")
    for name in PATTERN_NAMES:
        default = [s.id for s in build_pattern(name, OutboxSpec(), ALL).steps()]
        renamed = [s.id for s in build_pattern(name, custom, ALL).steps()]
        assert default == renamed


@pytest.mark.parametrize(("pattern", "step"), every_step(), ids=lambda v: getattr(v, "id", ""))
def test_every_step_is_fully_described(pattern: Pattern, step: Step) -> None:
    assert step.summary and not step.summary.endswith(".")
    assert step.app_before and step.app_after
    assert step.reverse_note
    if step.tx is TxMode.NONE:
        # A deploy gate: no SQL, no locks, its proof is its preconditions.
        assert step.kind.startswith("gate-")
        assert step.statements == () and step.locks == () and step.postcondition == ()
        assert step.preconditions
        return
    assert step.statements
    # GRANT takes no relation lock (it only updates catalog rows): a grant-only step
    # declares none, as the lock test on a real server checks.
    assert step.locks or step.kind.startswith("grant-")
    assert step.postcondition, "only gates may lack a postcondition"
    assert step.preconditions
    relations = [lock.relation for lock in step.locks]
    assert len(relations) == len(set(relations))
    if step.catalog_only:
        assert step.statement_timeout_ms is not None
    if step.reverse is None:
        assert step.reverse_note.startswith("irreversible")


@pytest.mark.parametrize("name", PATTERN_NAMES)
def test_point_of_no_return_is_the_only_irreversible_step(name: str) -> None:
    pattern = build_pattern(name, options=ALL)
    irreversible = [s.id for s in pattern.steps() if not s.reversible]
    assert irreversible == ([pattern.point_of_no_return] if pattern.point_of_no_return else [])
    if pattern.point_of_no_return:
        # Nothing after the point of no return but the optional original-name phases,
        # which reverse (their rename and view are undone before anything earlier).
        base = [s for s in pattern.steps() if s.phase not in OPTIONAL_PHASES]
        assert base[-1].id == pattern.point_of_no_return


def test_steps_that_scan_never_block_writers() -> None:
    """A step reading the whole table must not hold a lock that queues INSERT/UPDATE."""
    for _, step in every_step():
        if step.scan and not step.scan.startswith(("skipped", "none")):
            assert not any(lock.mode.blocks_writers for lock in step.locks), step.id
            assert step.statement_timeout_ms is None, step.id


def test_writer_blocking_locks_on_live_tables_are_catalog_only() -> None:
    """ACCESS EXCLUSIVE on a table the application uses must be brief: catalog-only, under
    a statement_timeout. Steps creating new, unused relations are exempt."""
    creators = {"create-partitioned-table", "create-unpublished-partition"}
    creators |= {"create-published-partition", "create-unpublished-index"}
    creators |= {"create-dead-letter-tables"}  # new tables (existing ones: adopted, not run)
    creators |= {"install-copy-trigger"}  # before V2: the published partition is still empty
    for _, step in every_step():
        if step.kind in creators or step.strongest_lock is None:
            continue
        if step.strongest_lock.blocks_writers:
            assert step.catalog_only, step.id
            assert step.statement_timeout_ms is not None, step.id


def test_swap_takes_access_exclusive_on_parent_and_attach_does_not() -> None:
    """DETACH (never CONCURRENTLY with a DEFAULT partition) locks the parent; ATTACH alone
    takes SHARE UPDATE EXCLUSIVE on it."""
    swap_step = next(s for s in build_pattern("hoper").steps() if s.kind == "swap-default")
    swap = {lock.relation: lock.mode for lock in swap_step.locks}
    assert swap["outbox_new"] is LockMode.ACCESS_EXCLUSIVE
    assert "CONCURRENTLY" not in " ".join(swap_step.sql_texts())
    attach = next(s for s in build_pattern("copra").steps() if s.kind == "attach-old-as-default")
    assert {lock.relation: lock.mode for lock in attach.locks}["outbox_new"] is (
        LockMode.SHARE_UPDATE_EXCLUSIVE
    )


def test_swap_is_one_transaction_detach_then_attach() -> None:
    for name in ("hoper", "hopia"):
        swap = next(s for s in build_pattern(name).steps() if s.kind == "swap-default")
        assert swap.tx is TxMode.TRANSACTION
        assert swap.sql_texts() == [
            'ALTER TABLE "public"."outbox_new" DETACH PARTITION "public"."outbox_published"',
            'ALTER TABLE "public"."outbox_new" ATTACH PARTITION "public"."outbox" DEFAULT',
        ]
        lines = step_sql(swap, 200, parent="outbox_new")
        assert lines[-1] == "COMMIT;"
        begin = lines.index("BEGIN;")
        # Only scans run before the transaction; inside it the locks come first (parent
        # first), then every check that must hold at commit, then the DDL.
        assert all("all-rows-present" in line for line in lines[:begin])
        body = lines[begin + 1 :]
        locks = [i for i, line in enumerate(body) if line.startswith("LOCK TABLE ONLY")]
        checks = [i for i, line in enumerate(body) if line.startswith("DO $om_assert$")]
        ddl = [i for i, line in enumerate(body) if line.startswith("ALTER TABLE")]
        assert body[locks[0]] == ('LOCK TABLE ONLY "public"."outbox_new" IN ACCESS EXCLUSIVE MODE;')
        assert max(locks) < min(checks) < max(checks) < min(ddl)


def test_hopia_swap_requires_every_row_copied_and_hoper_does_not() -> None:
    def names(pattern: str) -> set[str]:
        swap = next(s for s in build_pattern(pattern).steps() if s.kind == "swap-default")
        return {c.name for c in swap.preconditions}

    assert "all-rows-present:outbox_published->outbox" in names("hopia")
    assert "all-rows-present:outbox_published->outbox" not in names("hoper")


def test_identity_starts_above_old_max_in_every_pattern() -> None:
    for pattern in every_pattern():
        create = pattern.steps()[0]
        assert create.kind == "create-partitioned-table"
        start = create.sql_texts()[-2]  # the last one carries the old table's privileges
        assert "setval" in start and 'max("id")' in start and "1000000" in start


def test_every_created_table_carries_the_old_tables_privileges() -> None:
    """The parent gets every grant, the unpublished partition the relay's SELECT and UPDATE,
    the published partition only the owner — each in its creating transaction."""
    wanted = {
        "create-partitioned-table": "wanted text[] := NULL::text[]",
        "create-unpublished-partition": "wanted text[] := ARRAY['SELECT', 'UPDATE']::text[]",
        "create-published-partition": "wanted text[] := ARRAY[]::text[]",
    }
    for pattern in every_pattern():
        for step in pattern.steps():
            if step.kind in wanted:
                carry = step.sql_texts()[-1]
                assert carry.startswith("DO $om$") and wanted[step.kind] in carry, step.id
                assert "OWNER TO" in carry and step.tx.value == "transaction"
                assert step.former_checksums, step.id


def test_hopia_trigger_overrides_the_old_identity() -> None:
    trigger = next(s for s in build_pattern("hopia").steps() if s.kind == "install-copy-trigger")
    assert "OVERRIDING SYSTEM VALUE" in trigger.sql_texts()[0]
    assert 'AFTER INSERT ON "public"."outbox_published"' in trigger.sql_texts()[1]


def test_invariants_drop_what_later_steps_undo() -> None:
    hopia = build_pattern("hopia", options=ALL)
    final = {c.name for _, c in hopia.invariants("V4")}
    assert "trigger-exists" not in final and "check-exists" not in final
    assert "trigger-absent" in final and "check-absent" in final
    v2 = {c.name for _, c in hopia.invariants("V2")}
    assert "trigger-exists" in v2
    with pytest.raises(KeyError):
        hopia.invariants("V9")


def test_checksum_is_stable_and_follows_the_sql() -> None:
    first = build_pattern("hoper").steps()
    again = build_pattern("hoper").steps()
    assert [s.checksum() for s in first] == [s.checksum() for s in again]
    assert len({s.checksum() for s in first}) == len(first)
    step = first[0]
    changed_sql = dataclasses.replace(step, statements=(*step.statements, sql.SQL("SELECT 1")))
    assert changed_sql.checksum() != step.checksum()
    changed_tx = dataclasses.replace(step, tx=TxMode.AUTOCOMMIT)
    assert changed_tx.checksum() != step.checksum()
    relabelled = dataclasses.replace(step, summary="other words")
    assert relabelled.checksum() == step.checksum()
    renamed = build_pattern("hoper", OutboxSpec(table="events")).steps()[0]
    assert renamed.checksum() != step.checksum()
    # Preconditions say when a step may run, not what it does: tuning the gate's sampling
    # window must not make an applied step look changed.
    window = build_pattern("hoper", options=BuildOptions(sample_window_s=9)).phase("V4").steps[0]
    default = build_pattern("hoper").phase("V4").steps[0]
    assert [c.sql_text() for c in window.preconditions] != [
        c.sql_text() for c in default.preconditions
    ]
    assert window.checksum() == default.checksum()


def test_identifiers_are_quoted_by_psycopg() -> None:
    spec = OutboxSpec(schema="Billing", table='out"box', partitioned_table="Outbox New")
    texts = " ".join(t for s in build_pattern("hopia", spec, ALL).steps() for t in s.sql_texts())
    assert '"Billing"."out""box"' in texts
    assert '"Billing"."Outbox New"' in texts
    assert "Billing.out" not in texts


def test_offline_assertion_raises_the_violation_with_the_step_and_condition() -> None:
    step = build_pattern("copra").phase("V3").steps[0]
    drained = next(c for c in step.preconditions if c.name.startswith("old-table-drained"))
    block = assertion(step.id, drained)
    assert block.startswith("DO $om_assert$") and block.endswith("$om_assert$;")
    assert drained.sql_text() in block
    assert "precondition of copra.v3.gate-old-table-retired [old-table-drained:outbox]" in block


def test_the_drained_gate_names_the_way_out_for_stranded_rows() -> None:
    """Rows a writer added after the switching relay left the old table are published by
    nobody: the V3 gate's refusal says how to publish them, not only that they are there."""
    for name in ("hop", "hoper", "hopia"):
        gate = build_pattern(name).phase("V3").steps[0]
        drained = next(c for c in gate.preconditions if c.name.startswith("old-table-drained"))
        assert "outbox-migrate relay --mode flat --until-empty" in drained.sql_text()
        assert "run this phase again" in drained.sql_text()


def test_transactional_step_sql_takes_locks_then_checks_then_acts() -> None:
    """The offline SQL follows the runner's commit-time rule: timeouts, the declared locks
    (parent first), every precondition as an assertion, the DDL — in one transaction."""
    step = next(s for s in build_pattern("copra").steps() if s.kind == "attach-old-as-default")
    lines = step_sql(step, 150, parent="outbox_new")
    assert lines[0] == "BEGIN;" and lines[-1] == "COMMIT;"
    assert lines[1:5] == [
        "SET LOCAL lock_timeout = '150ms';",
        "SET LOCAL statement_timeout = '1000ms';",
        'LOCK TABLE ONLY "public"."outbox_new" IN SHARE UPDATE EXCLUSIVE MODE;',
        'LOCK TABLE ONLY "public"."outbox" IN ACCESS EXCLUSIVE MODE;',
    ]
    checks = lines[5:-2]
    assert all(line.startswith("DO $om_assert$") for line in checks)
    assert len(checks) == len(step.preconditions)
    assert lines[-2].startswith("ALTER TABLE")


def test_pattern_flags_agree_with_the_wizard() -> None:
    for pattern in every_pattern():
        answers = Answers(
            pattern.pause_publication, pattern.keep_old_rows, pattern.immediate_access
        )
        assert recommend(answers).pattern == pattern.name


def test_unknown_pattern_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="unknown pattern 'hopla'; choose one of cop, copra"):
        build_pattern("hopla")


def test_every_registered_kind_is_used_by_some_pattern() -> None:
    used = {s.kind.removesuffix("-old") for _, s in every_step()}
    assert used == set(load_all())


@pytest.mark.parametrize("name", PATTERN_NAMES)
def test_the_rename_restates_the_end_state(name: str) -> None:
    """After the rename every earlier postcondition names relations by their former names:
    the invariants are the renaming step's own (then the view's drop's), under the new names."""
    pattern = build_pattern(name, options=ALL)
    rename = pattern.phase("original-name").steps[0]
    drop = pattern.phase("drop-view").steps[-1]
    assert [s for s, _ in pattern.invariants("original-name")] == [rename] * len(
        rename.postcondition
    )
    assert [c.name for _, c in pattern.invariants("drop-view")] == [
        c.name for c in drop.postcondition
    ]
    assert "partitioned-by-list:outbox" in [c.name for c in rename.postcondition]
    # The drop done ahead of a phase the ledger still records: its end state is what holds.
    ahead = pattern.invariants("original-name", frozenset({drop.id}))
    assert [c.name for _, c in ahead] == [c.name for c in drop.postcondition]


def test_the_dead_letter_tables_take_the_outbox_id_type_and_the_relay_gets_delete() -> None:
    """Ids as the relay binds them (int8, or text for application ids such as uuid); the
    grants give the relay's roles DELETE on the unpublished partition (a dead letter leaves
    the outbox by DELETE) and are the grant step's postcondition."""
    for spec, id_type in ((OutboxSpec(), "int8"), (OutboxSpec(id_kind="application"), "text")):
        steps = {s.kind: s for s in build_pattern("hop", spec).steps()}
        create = steps["create-dead-letter-tables"].sql_texts()
        assert all(f"id {id_type} NOT NULL" in text for text in create[:2]), create[:2]
        grant = steps["grant-dead-letters"]
        assert "GRANT DELETE ON TABLE" in grant.sql_texts()[0]
        assert [c.name.split(":")[0] for c in grant.postcondition] == ["dead-letter-grants"]
