"""The Alembic operations `op.outbox_*` and how autogenerate renders them. The op objects are
inert (`execute.py` runs them); each knows its `reverse()`, so a revision gets its downgrade.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import KW_ONLY, dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

from alembic.autogenerate import renderers
from alembic.autogenerate.api import AutogenContext
from alembic.operations import MigrateOperation, Operations
from alembic.util import CommandError

from outbox_migrate.alembic_ext import execute
from outbox_migrate.errors import ExitCode, OutboxMigrateError, UsageError

if TYPE_CHECKING:
    from alembic.runtime.migration import MigrationContext

IMPORT_LINE = (
    "import outbox_migrate.alembic_ext  # noqa: F401 - registers op.outbox_step and friends"
)


@dataclass(eq=False)
class _OutboxOp(MigrateOperation):
    """Shared fields: what to run, the names pinned at generation, the transaction wish."""

    name: ClassVar[str] = ""
    target: str
    _: KW_ONLY
    phase: str | None = None
    spec: Mapping[str, Any] | None = None
    include_optional: bool = False
    in_revision_transaction: bool = False

    def __post_init__(self) -> None:
        self.spec = dict(self.spec) if self.spec is not None else None

    def reverse(self) -> _OutboxOp:
        return _REVERSES[type(self)](**{f.name: getattr(self, f.name) for f in fields(self)})

    def render(self, indent: str = "") -> str:
        """The call as it appears in a revision file; continuation lines get `indent`."""
        args = [repr(self.target)]
        if self.phase is not None:
            args.append(repr(self.phase))
        if self.spec:
            pairs = "".join(f"\n{indent}        {k!r}: {v!r}," for k, v in self.spec.items())
            args.append(f"spec={{{pairs}\n{indent}    }}")
        if self.include_optional:
            args.append("include_optional=True")
        if self.in_revision_transaction:
            args.append("in_revision_transaction=True")
        inner = "".join(f"\n{indent}    {arg}," for arg in args)
        return f"op.{self.name}({inner}\n{indent})"


@Operations.register_operation("outbox_step")
class OutboxStepOp(_OutboxOp):
    """Run one step of a pattern, e.g. `op.outbox_step("hoper.v4.swap-default")`."""

    name = "outbox_step"

    @classmethod
    def outbox_step(
        cls,
        operations: Operations,
        step_id: str,
        *,
        spec: Mapping[str, Any] | None = None,
        include_optional: bool = False,
        in_revision_transaction: bool = False,
    ) -> Any:
        """Apply the step: preconditions, lock budget and ledger as with `outbox-migrate run`.

        `spec` pins the table and column names (else: configuration). With
        `in_revision_transaction=True` and `transaction_per_migration`, the step commits in the
        revision's own transaction together with alembic_version.
        """
        op = cls(step_id, spec=spec, include_optional=include_optional,
                 in_revision_transaction=in_revision_transaction)  # fmt: skip
        return operations.invoke(op)


@Operations.register_operation("outbox_reverse_step")
class ReverseOutboxStepOp(_OutboxOp):
    """Undo one step (its reverse), or fail clearly when it has none."""

    name = "outbox_reverse_step"

    @classmethod
    def outbox_reverse_step(
        cls,
        operations: Operations,
        step_id: str,
        *,
        spec: Mapping[str, Any] | None = None,
        include_optional: bool = False,
        in_revision_transaction: bool = False,
    ) -> Any:
        op = cls(step_id, spec=spec, include_optional=include_optional,
                 in_revision_transaction=in_revision_transaction)  # fmt: skip
        return operations.invoke(op)


@Operations.register_operation("outbox_phase")
class OutboxPhaseOp(_OutboxOp):
    """Run every step of one phase, e.g. `op.outbox_phase("hoper", "V4")`; each step commits
    in its own transaction."""

    name = "outbox_phase"

    @classmethod
    def outbox_phase(
        cls,
        operations: Operations,
        pattern: str,
        phase: str,
        *,
        spec: Mapping[str, Any] | None = None,
        include_optional: bool = False,
    ) -> Any:
        """Apply `phase`'s steps in order (already-done ones are skipped via the ledger)."""
        return operations.invoke(
            cls(pattern, phase=phase, spec=spec, include_optional=include_optional)
        )


@Operations.register_operation("outbox_reverse_phase")
class ReverseOutboxPhaseOp(_OutboxOp):
    """Undo every step of one phase, newest first (refused if one is irreversible)."""

    name = "outbox_reverse_phase"

    @classmethod
    def outbox_reverse_phase(
        cls,
        operations: Operations,
        pattern: str,
        phase: str,
        *,
        spec: Mapping[str, Any] | None = None,
        include_optional: bool = False,
    ) -> Any:
        return operations.invoke(
            cls(pattern, phase=phase, spec=spec, include_optional=include_optional)
        )


_REVERSES: dict[type[_OutboxOp], type[_OutboxOp]] = {
    OutboxStepOp: ReverseOutboxStepOp, ReverseOutboxStepOp: OutboxStepOp,
    OutboxPhaseOp: ReverseOutboxPhaseOp, ReverseOutboxPhaseOp: OutboxPhaseOp,
}  # fmt: skip


# -- implementations -----------------------------------------------------------------------------


class AlembicStepError(OutboxMigrateError, CommandError):
    """An outbox-migrate error raised inside Alembic, as a `CommandError`: the `alembic` CLI
    prints it as one `FAILED: …` line instead of a traceback. `error` is the original."""

    def __init__(self, error: OutboxMigrateError) -> None:
        self.error = error
        self.exit_code = error.exit_code
        super().__init__(str(error))


class _Interrupted(OutboxMigrateError):
    """Ctrl-C during an operation under the `alembic` command."""

    exit_code = ExitCode.INTERRUPTED


INSUFFICIENT_PRIVILEGE = "42501"


def _missing_privilege(exc: BaseException) -> BaseException | None:
    """The database error in `exc`'s chain that says the role lacks a privilege, if any."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if getattr(cause, "sqlstate", None) == INSUFFICIENT_PRIVILEGE:
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def _under_alembic_command(ctx: MigrationContext) -> bool:
    """Whether the `alembic` command line runs us without `--raiseerr`: it prints a
    `CommandError` as one `FAILED:` line. Called from Python, an interrupt stays one."""
    options = getattr(ctx.config, "cmd_opts", None)
    return getattr(options, "raiseerr", None) is False


@contextmanager
def _reported(ctx: MigrationContext, doing: str) -> Iterator[None]:
    """Errors as `AlembicStepError`, one line each: ours, a privilege the role lacks (as
    `outbox-migrate run` reports it, the role named), and Ctrl-C under the `alembic` command
    (the step's transaction rolled back and the revision unrecorded, like any failed step;
    Alembic then exits 255, its status for every failure, not 130)."""
    try:
        yield
    except AlembicStepError:
        raise
    except OutboxMigrateError as exc:
        raise AlembicStepError(exc) from exc
    except KeyboardInterrupt as exc:
        if not _under_alembic_command(ctx):
            raise
        raise AlembicStepError(_Interrupted(
            f"interrupted (Ctrl-C) during {doing}; alembic_version does not record this "
            "revision and the ledger keeps every step that completed — re-run the same "
            "`alembic` command to continue"
        )) from exc  # fmt: skip
    except Exception as exc:
        denied = _missing_privilege(exc)
        if denied is None:
            raise
        line = (str(denied).strip().splitlines() or [type(denied).__name__])[0]
        raise AlembicStepError(UsageError(
            f"{line}: the role {execute.role_of(ctx)} lacks a privilege the migration needs "
            "(`outbox-migrate roles` checks them, docs/roles.md lists them)"
        )) from exc  # fmt: skip


def _run(operations: Operations, op: _OutboxOp) -> None:
    """A step op names its pattern in its id; a phase op names the pattern itself."""
    reverse = isinstance(op, ReverseOutboxStepOp | ReverseOutboxPhaseOp)
    pattern = execute.pattern_of(op.target) if op.phase is None else op.target
    steps = [op.target] if op.phase is None else None
    what = f"step {op.target}" if op.phase is None else f"phase {op.phase} of {op.target}"
    ctx = operations.get_context()
    with _reported(ctx, f"the reverse of {what}" if reverse else what):
        execute.apply_steps(
            ctx, pattern, steps, op.phase, op.spec,
            op.include_optional, op.in_revision_transaction, reverse=reverse,
        )  # fmt: skip


# -- rendering into revision files ---------------------------------------------------------------


def _render(autogen_context: AutogenContext, op: _OutboxOp) -> str:
    autogen_context.imports.add(IMPORT_LINE)
    return op.render("    ")


for _cls in (OutboxStepOp, ReverseOutboxStepOp, OutboxPhaseOp, ReverseOutboxPhaseOp):
    Operations.implementation_for(_cls)(_run)
    renderers.dispatch_for(_cls)(_render)
