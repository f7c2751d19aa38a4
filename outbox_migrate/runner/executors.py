"""Who carries a step out: SQL steps and job steps (the copy-back) behind one protocol — prove
it is done, apply it — so the applier never branches on step kinds.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any, Protocol

from psycopg import Connection

from outbox_migrate.config import OutboxSpec
from outbox_migrate.patterns.model import Condition, Step, TxMode
from outbox_migrate.runner.events import RunnerEvents


class ProofHost(Protocol):
    """What proving a step needs: a connection and the table's names. Read-only."""

    conn: Connection[Any]
    spec: OutboxSpec

    def violations(self, conditions: Iterable[Condition]) -> list[str]: ...


class ApplyHost(ProofHost, Protocol):
    """What applying a step needs besides (`runner.apply.StepApplier` is the one host; a
    protocol here keeps executors from importing the applier that imports them)."""

    events: RunnerEvents
    copy_back_options: Any
    job_dsn: str | None

    def apply_in_transaction(self, step: Step) -> float: ...

    def apply_autocommit(self, step: Step) -> float: ...

    def prove_done(self, step: Step) -> None: ...

    def transition(
        self, step: Step, target: str, *, started: bool = False,
        started_at: datetime | None = None,
    ) -> None: ...  # fmt: skip


class StepExecutor(Protocol):
    def proven(self, host: ProofHost, step: Step) -> bool:
        """True when the step's effect is in place (its postcondition holds)."""

    def apply(self, host: ApplyHost, step: Step) -> float:
        """Do the step and record it done; return milliseconds lost waiting for locks."""


class SqlExecutor:
    def proven(self, host: ProofHost, step: Step) -> bool:
        return bool(step.postcondition) and not host.violations(step.postcondition)

    def apply(self, host: ApplyHost, step: Step) -> float:
        if step.tx is TxMode.AUTOCOMMIT:
            return host.apply_autocommit(step)
        return host.apply_in_transaction(step)


class CopyBackExecutor:
    """HOPER's copy-back: the job in `outbox_migrate.jobs.copy_back`, resumable from its own
    high-water mark whoever started it."""

    def _source_dropped_after_copy(self, host: ProofHost) -> bool:
        from outbox_migrate.jobs.copy_back import finished_and_dropped

        return finished_and_dropped(host.conn, host.spec)

    def proven(self, host: ProofHost, step: Step) -> bool:
        if self._source_dropped_after_copy(host):
            return True
        from outbox_migrate.jobs.common import Relation, exists

        if not exists(host.conn, Relation(host.spec.schema, host.spec.published_partition)):
            return False
        return not host.violations(step.postcondition)

    def apply(self, host: ApplyHost, step: Step) -> float:
        from outbox_migrate.jobs.copy_back import CopyProgress, copy_back

        host.transition(step, "running", started=True)

        def progress(update: CopyProgress) -> None:
            host.events.progress(step, update.copied_rows, update.total_rows, update.rows_per_s)

        copy_back(
            host.conn, host.spec, host.copy_back_options, dsn=host.job_dsn,
            drop=False, progress=progress,
        )  # fmt: skip
        if self._source_dropped_after_copy(host):
            host.transition(step, "done")
            return 0.0
        host.prove_done(step)
        return 0.0


EXECUTORS: dict[str, StepExecutor] = {"sql": SqlExecutor(), "copy-back": CopyBackExecutor()}


def executor_for(step: Step) -> StepExecutor:
    try:
        return EXECUTORS[step.executor]
    except KeyError:
        raise ValueError(f"{step.id}: no executor {step.executor!r}") from None
