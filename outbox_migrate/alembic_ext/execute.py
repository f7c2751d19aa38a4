"""How an outbox-migrate operation runs inside Alembic: online through the runner on Alembic's
own connection, offline (`--sql`) as SQL with every precondition an assertion (docs/alembic.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

from outbox_migrate.config import OutboxSpec, Settings, load_settings
from outbox_migrate.errors import UsageError
from outbox_migrate.lock_budget import AttemptLog
from outbox_migrate.offline import assertion, cdc_guard, lock_statements, step_sql
from outbox_migrate.patterns import build_from_settings
from outbox_migrate.patterns.model import Pattern, Step, TxMode
from outbox_migrate.runner.decide import irreversible, phase_index, step_named
from outbox_migrate.runner.events import SilentEvents

if TYPE_CHECKING:
    import psycopg
    from alembic.runtime.migration import MigrationContext

    from outbox_migrate.runner import Runner

LOGGER = logging.getLogger("alembic.outbox_migrate")
"""Under Alembic's logger, so the project's alembic.ini logging config shows our lines."""


class LoggingEvents(SilentEvents):
    """Runner events as log lines next to Alembic's own "Running upgrade …"."""

    def step_started(self, step: Step, action: str) -> None:
        LOGGER.info("outbox-migrate: %s: %s", step.id, action)

    def attempt(self, step: Step, log: AttemptLog) -> None:
        if log.outcome != "done":
            who = ", ".join(b.describe() for b in log.blockers[:3]) or "unknown"
            LOGGER.warning(
                "outbox-migrate: %s: attempt %d hit lock_timeout after %.0f ms (held by %s)",
                step.id, log.attempt, log.waited_ms, who,
            )  # fmt: skip

    def step_finished(self, step: Step, outcome: str, elapsed_s: float) -> None:
        LOGGER.info("outbox-migrate: %s: %s in %.2f s", step.id, outcome, elapsed_s)

    def warning(self, step: Step, message: str) -> None:
        LOGGER.warning("outbox-migrate: %s: %s", step.id, message)


# -- inputs ----------------------------------------------------------------------------------


def pattern_of(step_id: str) -> str:
    """`hoper.v4.swap-default` → `hoper`."""
    name, _, rest = step_id.partition(".")
    if not rest:
        raise UsageError(f"{step_id!r} is not a step id (expected e.g. hoper.v4.swap-default)")
    return name


def settings_for(spec: Mapping[str, Any] | None) -> Settings:
    """Environment and config file, with the names pinned in the revision taking precedence:
    a revision keeps doing what it did when it was generated. Revisions generated before the
    guard was pinned whatever its value left it out when it was on, so a pinned spec without
    it means on: the configuration must not take a step out of a chain that has its revision."""
    pinned = dict(spec or {})
    if spec is not None:
        pinned.setdefault("unpublished_guard", True)
    return load_settings(pinned)


def select(pattern: Pattern, step_ids: list[str] | None, phase: str | None) -> list[Step]:
    """The named steps, or every step of `phase`, in pattern order."""
    if step_ids is not None:
        return [step_named(pattern, s) for s in step_ids]
    return list(pattern.phases[phase_index(pattern, phase or "")].steps)


def with_live_steps(
    live: Pattern, built: Pattern, steps: list[Step], *, reverse: bool = False
) -> list[str]:
    """The step ids to apply, with the conditional steps only the live database knows of
    (the CDC step, when a publication covers the old table) slotted in where the runner's
    pattern has them: a revision generated without a DSN has no such step, but the runner
    requires every earlier step of the phase (and unwinds newest first)."""
    known = {s.id for s in built.steps()}
    order = live.steps()
    position = {s.id: index for index, s in enumerate(order)}
    ids: list[str] = []
    for step in steps:
        at = position.get(step.id)
        if at is not None:
            extra = [s for s in order if s.phase == step.phase and s.id not in known]
            if reverse:
                before = [s.id for s in reversed(extra) if position[s.id] > at]
            else:
                before = [s.id for s in extra if position[s.id] < at]
            ids += [i for i in before if i not in ids]
        ids.append(step.id)
    return ids


# -- transactions ----------------------------------------------------------------------------


def revision_has_own_transaction(ctx: MigrationContext) -> bool:
    """True when Alembic runs each revision in its own transaction (online and `--sql`)."""
    per_migration = bool(ctx.opts.get("transaction_per_migration", False))
    external = bool(getattr(ctx, "_in_external_transaction", False))
    return per_migration and ctx.impl.transactional_ddl and not external


def joins_revision(ctx: MigrationContext, steps: list[Step], requested: bool) -> bool:
    """Whether the steps run inside the revision's transaction (else: their own). A step that
    refuses a transaction block (CONCURRENTLY, the copy-back job) never joins it."""
    return (
        requested
        and len(steps) == 1
        and steps[0].tx is not TxMode.AUTOCOMMIT
        and revision_has_own_transaction(ctx)
    )


def _driver(ctx: MigrationContext) -> psycopg.Connection[Any]:
    import psycopg

    bind = ctx.connection
    if bind is None:  # pragma: no cover - online mode always has one
        raise UsageError("Alembic has no connection (online mode expected)")
    raw = bind.connection.driver_connection
    if not isinstance(raw, psycopg.Connection):
        raise UsageError(
            "outbox-migrate's Alembic operations need the psycopg 3 driver: use a "
            f"postgresql+psycopg:// URL (this one uses {bind.dialect.driver})"
        )
    return raw


def role_of(ctx: MigrationContext) -> str:
    """The role Alembic's connection logged in as (the URL may leave it to libpq)."""
    return _driver(ctx).info.user


@contextmanager
def _runner(
    ctx: MigrationContext, pattern: str, settings: Settings, include_optional: bool, joined: bool
) -> Iterator[Runner]:
    """A runner on Alembic's connection: inside the revision's transaction (`joined`) or in
    autocommit mode, where each step opens and commits its own transaction."""
    from psycopg.pq import TransactionStatus

    from outbox_migrate.runner import Runner, ledger

    # Before the revision's transaction does anything: create the ledger in its own short
    # transaction, so the setup lock is not held while the step runs.
    with ctx.autocommit_block():
        ledger.ensure_schema(_driver(ctx))
    with nullcontext() if joined else ctx.autocommit_block():
        conn = _driver(ctx)
        if joined and conn.info.transaction_status == TransactionStatus.IDLE:
            # SQLAlchemy begins lazily; start the revision's transaction now so the step's
            # work (and its lock-budget savepoints) join it instead of committing alone.
            conn.execute("SELECT 1")
        runner = Runner.attached(
            conn, settings, pattern, include_optional=include_optional, events=LoggingEvents()
        )
        with runner:
            yield runner


# -- offline SQL -----------------------------------------------------------------------------


def _header(step: Step, verb: str) -> str:
    return f"-- outbox-migrate {verb}: {step.id}: {step.summary}"


def forward_sql(
    step: Step, lock_timeout_ms: int, *, joined: bool, spec: OutboxSpec | None = None
) -> str:
    """A step as psql text: its own BEGIN … COMMIT, or the body alone when it joins the
    revision's transaction. The declared locks come first inside it, then every check that
    must hold at commit, as assertions."""
    spec = spec or OutboxSpec()
    lines = step_sql(step, lock_timeout_ms, schema=spec.schema, parent=spec.partitioned_table)
    if joined and step.tx is TxMode.TRANSACTION:
        if lines[-1] != "COMMIT;" or "BEGIN;" not in lines:  # pragma: no cover - step_sql's shape
            raise ValueError("unexpected step SQL shape")
        begin = lines.index("BEGIN;")
        lines = lines[:begin] + lines[begin + 1 : -1]
    return "\n".join([_header(step, "step"), *lines])


def reverse_sql(
    step: Step, lock_timeout_ms: int, *, joined: bool, spec: OutboxSpec | None = None
) -> str:
    """A step's reverse as psql text: its locks, then its reverse preconditions as
    assertions (so an emptiness check cannot be stale at COMMIT), then the statements."""
    if step.reverse is None:
        raise irreversible(step)
    if not step.reverse:
        return f"{_header(step, 'reverse')}\n-- nothing to undo: {step.reverse_note}"
    spec = spec or OutboxSpec()
    locks = lock_statements(step, spec.schema, spec.partitioned_table, skip_created=False)
    body = [
        f"SET LOCAL lock_timeout = '{lock_timeout_ms}ms';",
        "SET LOCAL statement_timeout = '0ms';",
        *locks,
        *(assertion(f"{step.id} (reverse)", c) for c in step.reverse_preconditions),
        *(s.as_string(None).rstrip(";") + ";" for s in step.reverse),
    ]
    if not joined:
        body = ["BEGIN;", *body, "COMMIT;"]
    return "\n".join([_header(step, "reverse"), *body])


def _emit(ctx: MigrationContext, texts: list[str], joined: bool) -> None:
    with nullcontext() if joined else ctx.autocommit_block():
        for text in texts:
            ctx.impl.static_output(text)


# -- the operations ----------------------------------------------------------------------------


def apply_steps(
    ctx: MigrationContext,
    pattern_name: str,
    step_ids: list[str] | None,
    phase: str | None,
    spec: Mapping[str, Any] | None,
    include_optional: bool,
    in_revision_transaction: bool,
    *,
    reverse: bool = False,
) -> None:
    """Apply the named steps (or every step of `phase`) in pattern order; with `reverse`,
    undo them newest first, refused before touching anything when one is irreversible."""
    settings = settings_for(spec)
    pattern = build_from_settings(pattern_name, settings, include_optional=include_optional)
    steps = select(pattern, step_ids, phase)
    if reverse:
        steps.reverse()
        for step in steps:
            if step.reverse is None:
                raise irreversible(step)
    joined = joins_revision(ctx, steps, in_revision_transaction)
    if ctx.as_sql:
        timeout, names = settings.lock_timeout_ms, settings.spec
        texts = [
            text
            for s in steps
            for text in (
                [reverse_sql(s, timeout, joined=joined, spec=names)]
                if reverse
                else [forward_sql(s, timeout, joined=joined, spec=names),
                      *cdc_guard(pattern, s, names)]
            )
        ]  # fmt: skip
        _emit(ctx, texts, joined)
        return
    with _runner(ctx, pattern_name, settings, include_optional, joined) as runner:
        for step_id in with_live_steps(runner.pattern, pattern, steps, reverse=reverse):
            if reverse:
                runner.reverse_step(step_id)
            else:
                runner.execute_step(step_id)
