"""`outbox-migrate alembic generate`: write a pattern's revisions with Alembic's own machinery,
so they look like the project's other revisions. Returns what it wrote; never prints.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from outbox_migrate.alembic_ext.revisions import (
    RevisionPlan,
    Split,
    phase_targets,
    plan_revisions,
)
from outbox_migrate.config import Settings
from outbox_migrate.errors import UsageError
from outbox_migrate.patterns import build_from_settings
from outbox_migrate.patterns.model import Pattern
from outbox_migrate.plan import MARKER_KEYS


@dataclass
class Generated:
    """What `generate` wrote: the chain, and the revision that completes each phase."""

    pattern: str
    script_location: str
    down_revision: str | None
    revisions: list[dict[str, Any]] = field(default_factory=list)
    phase_targets: dict[str, str] = field(default_factory=dict)
    hints: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def load_config(directory: Path) -> Any:
    """An Alembic `Config` for `directory`: a folder holding alembic.ini, an alembic.ini file,
    or a script directory (env.py + script.py.mako) without an ini."""
    from argparse import Namespace

    from alembic.config import Config

    quiet = Namespace(quiet=True)  # Alembic prints "Generating …"; we report it ourselves
    if directory.is_file():
        return Config(str(directory), cmd_opts=quiet)
    if (directory / "alembic.ini").is_file():
        return Config(str(directory / "alembic.ini"), cmd_opts=quiet)
    if (directory / "script.py.mako").is_file():
        config = Config(cmd_opts=quiet)
        config.set_main_option("script_location", str(directory))
        return config
    raise UsageError(
        f"no Alembic project in {directory}: expected alembic.ini or a script directory "
        "(script.py.mako); create one with `alembic init`, or pass --dir"
    )


VERSION_NUM_LENGTH = 32
"""Alembic's `alembic_version.version_num` is VARCHAR(32): a longer revision id is written
without complaint, and `alembic upgrade` fails on it once the pipeline reaches it."""


@contextmanager
def _history(script: Any) -> Iterator[None]:
    """Alembic's errors reading the project's revisions (a cycle, a missing parent) as one
    line: the history is the user's to repair, and nothing is written until it reads."""
    from alembic.script.revision import RevisionError
    from alembic.util import CommandError

    try:
        yield
    except (CommandError, RevisionError) as exc:
        raise UsageError(
            f"the Alembic history in {script.versions} cannot be read ({exc}); repair it "
            "(`alembic heads` and `alembic history` show it), then generate again"
        ) from None


def current_head(config: Any) -> str | None:
    """The project's single head (None for an empty project)."""
    from alembic.script import ScriptDirectory
    from alembic.script.revision import MultipleHeads
    from alembic.util import CommandError

    script = ScriptDirectory.from_config(config)
    with _history(script):
        try:
            return script.get_current_head()
        except CommandError as exc:
            if not isinstance(exc.__cause__, MultipleHeads):
                raise
            heads = ", ".join(script.get_heads())
    raise UsageError(
        f"the Alembic project has several heads ({heads}); choose one with --down-revision"
    )


def _parent(script: Any, down_revision: str) -> bool:
    """Check that `down_revision` exists; whether chaining after it splices (it is not a
    head)."""
    from alembic.script.revision import ResolutionError
    from alembic.util import CommandError

    with _history(script):
        try:
            script.get_revision(down_revision)
        except CommandError as exc:
            if not isinstance(exc.__cause__, ResolutionError):
                raise
            raise UsageError(
                f"--down-revision {down_revision!r}: no such revision in {script.versions}; "
                "`alembic history` lists them"
            ) from None
        return down_revision not in script.get_heads()


def _plan(script: Any, pattern: Pattern, tag: str | None, split: Split) -> list[RevisionPlan]:
    """The revisions to write, refused before any file when one cannot be: an id the project
    already has (writing it would replace a reviewed, maybe applied revision and chain its
    copy after the head, a cycle), or one longer than `alembic_version` holds. A random tag
    that is taken is drawn again."""
    with _history(script):
        existing = {revision.revision for revision in script.walk_revisions()}
    for _ in range(8):
        plans = plan_revisions(pattern, tag or secrets.token_hex(2), split)
        taken = [plan.rev_id for plan in plans if plan.rev_id in existing]
        if not taken:
            break
        if tag is not None:
            raise UsageError(
                f"revision {taken[0]} already exists in {script.versions} (--tag {tag} was "
                "used before): a generated revision is never rewritten; choose another --tag"
            )
    else:  # pragma: no cover - eight random tags of 65536 all taken
        raise UsageError(f"every random tag drawn is taken in {script.versions}; pass --tag")
    longest = max((plan.rev_id for plan in plans), key=len)
    if len(longest) > VERSION_NUM_LENGTH:
        room = VERSION_NUM_LENGTH - (len(longest) - len(tag or ""))
        raise UsageError(
            f"--tag {tag}: revision id {longest} ({len(longest)} characters) would not fit "
            f"Alembic's alembic_version.version_num, which holds {VERSION_NUM_LENGTH} "
            f"characters; use a tag of at most {room} for this pattern"
        )
    return plans


def _spec_of(settings: Settings) -> dict[str, Any]:
    spec = asdict(settings.spec)
    # Accepting a lost unique key is pinned only when it was made at generation: pinned
    # empty, it would override the acceptance in the configuration the revision runs with.
    if not spec["accept_lost_unique"]:
        del spec["accept_lost_unique"]
    # Likewise the marker's values: unset, they are read from the column's DEFAULT (online)
    # or from the configuration the revision runs with; pinned empty they would override it.
    for key in MARKER_KEYS:
        if spec.get(key) == "":
            del spec[key]
    # Every setting that decides the step list stays, whatever its value (`unpublished_guard`:
    # a guard-unpublished step): left to the configuration the revision runs with, it would
    # name steps that pattern does not have and stop the phase half-way.
    return spec


def generate(
    pattern_name: str,
    settings: Settings,
    directory: Path,
    *,
    down_revision: str | None = None,
    split: Split = Split.STEP,
    include_optional: bool = False,
    tag: str | None = None,
) -> Generated:
    """Write one revision per step (or per phase) of `pattern_name`, chained after the
    project's head (or `down_revision`); each one calls `op.outbox_step`."""
    from alembic.script import ScriptDirectory

    from outbox_migrate.alembic_ext.ops import IMPORT_LINE, OutboxPhaseOp, OutboxStepOp

    if tag is not None and not re.fullmatch(r"[A-Za-z0-9]+", tag):
        raise UsageError(f"--tag {tag!r}: use letters and digits only")
    config = load_config(directory)
    script = ScriptDirectory.from_config(config)
    parent = down_revision if down_revision is not None else current_head(config)
    splice = down_revision is not None and _parent(script, down_revision)
    pattern = build_from_settings(pattern_name, settings, include_optional=include_optional)
    plans = _plan(script, pattern, tag, split)
    spec = _spec_of(settings)
    result = Generated(pattern.name, script.dir, parent)
    for plan in plans:
        forward: OutboxStepOp | OutboxPhaseOp
        if split is Split.STEP:
            # One step per revision: it may share the revision's transaction (and commit
            # together with alembic_version) when the env gives each revision its own.
            forward = OutboxStepOp(plan.step_ids[0], spec=spec, include_optional=include_optional,
                                   in_revision_transaction=True)  # fmt: skip
        else:
            forward = OutboxPhaseOp(
                pattern.name, phase=plan.phase, spec=spec, include_optional=include_optional
            )
        written = script.generate_revision(
            plan.rev_id,
            plan.message,
            head=parent if parent is not None else "base",
            splice=splice,
            upgrades=forward.render("    "),
            downgrades=forward.reverse().render("    "),
            imports=IMPORT_LINE,
        )
        splice = False
        result.revisions.append(
            {
                "revision": plan.rev_id,
                "down_revision": parent,
                "phase": plan.phase,
                "phase_kind": plan.phase_kind.value,
                "position": f"{plan.position}/{plan.of}",
                "steps": list(plan.step_ids),
                "reversible": plan.reversible,
                "summary": plan.summary,
                "path": written.path if written is not None else None,
            }
        )
        parent = plan.rev_id
    result.phase_targets = phase_targets(plans)
    result.hints = _hints(script.dir)
    return result


def _hints(script_dir: str) -> list[str]:
    env = Path(script_dir) / "env.py"
    text = env.read_text("utf-8") if env.is_file() else ""
    if "transaction_per_migration" not in text:
        return [
            f"{env}: pass transaction_per_migration=True to context.configure() (online and "
            "offline) so each step commits together with alembic_version; without it every "
            "step still gets its own transaction, committed just before the version update"
        ]
    return []
