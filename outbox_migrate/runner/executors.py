"""Who carries a step out. The engine looks the executor up by `Step.executor` and never
branches on step kinds: SQL steps (transactional or not) and job steps (the copy-back) share
one small protocol — prove it is done, apply it.

A job step cannot run in one transaction, so it states what it re-proves at its end: the
copy-back proves every row of the source is in the target (its postcondition) before the
ledger says done; a copy-back finished by the standalone `outbox-migrate copy-back` command
(source verified and dropped, recorded in the job's own progress table) counts as proven, so
either entry point finishes what the other started.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from outbox_migrate.patterns.model import Step, TxMode

if TYPE_CHECKING:
    from outbox_migrate.runner.engine import Runner
    from outbox_migrate.runner.ledger import MigrationRow


class StepExecutor(Protocol):
    def proven(self, runner: Runner, step: Step) -> bool:
        """True when the step's effect is in place (its postcondition holds)."""

    def apply(self, runner: Runner, migration: MigrationRow, step: Step) -> float:
        """Do the step and record it done; return milliseconds lost waiting for locks."""


class SqlExecutor:
    def proven(self, runner: Runner, step: Step) -> bool:
        return bool(step.postcondition) and not runner._violations(step.postcondition)

    def apply(self, runner: Runner, migration: MigrationRow, step: Step) -> float:
        if step.tx is TxMode.AUTOCOMMIT:
            return runner.apply_autocommit(migration, step)
        return runner.apply_in_transaction(migration, step)


class CopyBackExecutor:
    """HOPER's copy-back: the job in `outbox_migrate.jobs.copy_back`, resumable from its own
    high-water mark whoever started it."""

    def _source_dropped_after_copy(self, runner: Runner) -> bool:
        from outbox_migrate.jobs.copy_back import finished_and_dropped

        return finished_and_dropped(runner.conn, runner.spec)

    def proven(self, runner: Runner, step: Step) -> bool:
        if self._source_dropped_after_copy(runner):
            return True
        from outbox_migrate.jobs import common
        from outbox_migrate.jobs.common import Relation

        source = Relation(runner.spec.schema, runner.spec.published_partition)
        if not common.exists(runner.conn, source):
            return False
        return not runner._violations(step.postcondition)

    def apply(self, runner: Runner, migration: MigrationRow, step: Step) -> float:
        from outbox_migrate.jobs.copy_back import copy_back
        from outbox_migrate.runner import ledger

        ledger.mark(runner.conn, migration.id, step.id, "running", started=True)

        def progress(update: Any) -> None:
            runner.events.progress(
                step, int(getattr(update, "copied", 0)), int(getattr(update, "total", 0)),
                float(getattr(update, "rows_per_s", 0.0)),
            )  # fmt: skip

        copy_back(
            runner.conn, runner.spec, runner.copy_back_options, dsn=runner.job_dsn,
            drop=False, progress=progress,
        )  # fmt: skip
        if self._source_dropped_after_copy(runner):
            ledger.mark(runner.conn, migration.id, step.id, "done")
            return 0.0
        runner.prove_done(migration, step)
        return 0.0


EXECUTORS: dict[str, StepExecutor] = {"sql": SqlExecutor(), "copy-back": CopyBackExecutor()}


def executor_for(step: Step) -> StepExecutor:
    try:
        return EXECUTORS[step.executor]
    except KeyError:
        raise ValueError(f"{step.id}: no executor {step.executor!r}") from None
