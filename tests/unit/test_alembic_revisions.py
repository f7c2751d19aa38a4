"""Alembic generation without a database: how patterns split into revisions, what the files
and the `--sql` output look like, and the errors a CI job would meet."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from alembic import command
from alembic.config import Config

from outbox_migrate.alembic_ext import AlembicStepError
from outbox_migrate.alembic_ext.execute import reverse_sql
from outbox_migrate.alembic_ext.generate import generate
from outbox_migrate.alembic_ext.revisions import Split, phase_targets, plan_revisions
from outbox_migrate.config import load_settings
from outbox_migrate.errors import OutOfOrder, UsageError
from outbox_migrate.patterns import PATTERN_NAMES, build_pattern

SETTINGS = load_settings({}, environ={})
URL = "postgresql+psycopg://app@db.invalid/app"


@pytest.mark.parametrize("name", PATTERN_NAMES)
def test_one_revision_per_step_in_pattern_order(name: str) -> None:
    pattern = build_pattern(name)
    plans = plan_revisions(pattern, "ab12")
    assert [p.step_ids[0] for p in plans] == [s.id for s in pattern.steps()]
    assert all(len(p.step_ids) == 1 for p in plans)
    assert len({p.rev_id for p in plans}) == len(plans)
    with_steps = [ph.name for ph in pattern.phases if ph.steps]
    assert list(phase_targets(plans)) == with_steps
    for plan in plans:
        assert plan.phase in plan.message and pattern.acronym in plan.message


def test_phase_split_gives_one_revision_per_phase() -> None:
    plans = plan_revisions(build_pattern("hoper"), "ab12", Split.PHASE)
    assert [(p.rev_id, p.phase) for p in plans] == [
        ("ab12_hoper_v2", "V2"), ("ab12_hoper_v3", "V3"), ("ab12_hoper_v4", "V4"),
        ("ab12_hoper_copy_back", "copy-back"),
    ]  # fmt: skip
    assert [p.reversible for p in plans] == [True, True, True, False]
    assert "before deploying V2" in plans[0].message
    assert "job copy-back" in plans[-1].message


def _project(root: Path, *, per_migration: bool) -> Path:
    ini = root / "alembic.ini"
    command.init(Config(str(ini), stdout=io.StringIO()), str(root / "migrations"))
    if per_migration:
        env = root / "migrations" / "env.py"
        env.write_text(
            env.read_text().replace(
                "target_metadata=target_metadata",
                "target_metadata=target_metadata, transaction_per_migration=True",
            )
        )
    return ini


def _sql(ini: Path, *args: str, downgrade: bool = False) -> str:
    buffer = io.StringIO()
    config = Config(str(ini), output_buffer=buffer, stdout=io.StringIO())
    config.set_main_option("sqlalchemy.url", URL)
    (command.downgrade if downgrade else command.upgrade)(config, *args, sql=True)
    return buffer.getvalue()


def test_revision_file_calls_the_library(tmp_path: Path) -> None:
    ini = _project(tmp_path, per_migration=True)
    result = generate("copra", SETTINGS, tmp_path, tag="c1")
    first = Path(result.revisions[0]["path"])
    text = first.read_text()
    assert "import outbox_migrate.alembic_ext" in text
    assert "op.outbox_step(\n        'copra.v2.create-partitioned-table'," in text
    assert "op.outbox_reverse_step(" in text
    assert "'table': 'outbox'," in text and "in_revision_transaction=True" in text
    assert result.hints == []  # env.py has transaction_per_migration
    assert ini.is_file()


def test_offline_step_joins_the_revision_transaction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTBOX_MIGRATE_GATE_WINDOW_S", "0.1")
    ini = _project(tmp_path, per_migration=True)
    generate("hoper", SETTINGS, tmp_path, tag="h1")
    text = _sql(ini, "h1_hoper_v4_04:h1_hoper_v4_05")
    body = text[text.index("-- Running upgrade") :]
    # One transaction: SET LOCAL, the locks, the assertions (under the locks: what they
    # prove holds at COMMIT), the swap, the version update, COMMIT.
    assert body.count("BEGIN;\n") == 0 and body.count("COMMIT;") == 1
    assert body.index("SET LOCAL lock_timeout = '200ms';") < body.index("LOCK TABLE ONLY")
    assert body.index("LOCK TABLE ONLY") < body.index("DO $om_assert$")
    assert body.index("ATTACH PARTITION") < body.index("UPDATE alembic_version")
    assert "RAISE EXCEPTION 'outbox-migrate: precondition of hoper.v4.swap-default" in body
    # The copy-back job cannot run in a transaction: autocommit block, then the version.
    job = _sql(ini, "h1_hoper_v4_07:h1_hoper_copy_back_01")
    job = job[job.index("-- Running upgrade") :]
    assert job.index("COMMIT;") < job.index("DO $om_copy$") < job.index("BEGIN;")


def test_offline_step_in_its_own_transaction_without_per_migration(tmp_path: Path) -> None:
    ini = _project(tmp_path, per_migration=False)
    generate("hop", SETTINGS, tmp_path, tag="p1")
    text = _sql(ini, "p1_hop_v2_01:p1_hop_v2_02")
    body = text[text.index("-- Running upgrade") :]
    # Alembic's transaction is committed, the step has its own BEGIN … COMMIT, then Alembic
    # begins again for the version update: SET LOCAL ends with the step.
    step = body.index("-- outbox-migrate step: hop.v2.create-unpublished-partition")
    assert body.index("COMMIT;") < step
    assert body.index("BEGIN;", step) < body.index("CREATE TABLE", step)
    assert body.index("UPDATE alembic_version") > body.index("COMMIT;", step)


def test_offline_downgrade_is_the_reverse_or_a_clear_error(tmp_path: Path) -> None:
    ini = _project(tmp_path, per_migration=True)
    generate("hoper", SETTINGS, tmp_path, tag="d1")
    back = _sql(ini, "d1_hoper_v4_05:d1_hoper_v4_04", downgrade=True)
    assert 'ATTACH PARTITION "public"."outbox_published" DEFAULT' in back
    assert "precondition of hoper.v4.swap-default (reverse)" in back
    with pytest.raises(
        AlembicStepError, match=r"cannot roll back hoper\.copy-back\.drop-published"
    ) as refused:
        _sql(ini, "d1_hoper_copy_back_02:d1_hoper_copy_back_01", downgrade=True)
    assert isinstance(refused.value.error, OutOfOrder)


def test_reverse_without_statements_says_so() -> None:
    gate = build_pattern("hoper").phase("V3").steps[0]
    assert "nothing to undo" in reverse_sql(gate, 200, joined=True)


def test_generate_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no Alembic project"):
        generate("hoper", SETTINGS, tmp_path)
    _project(tmp_path, per_migration=True)
    with pytest.raises(UsageError, match="--tag"):
        generate("hoper", SETTINGS, tmp_path, tag="no spaces")
    generate("hop", SETTINGS, tmp_path, tag="a1")
    # A second chain from base makes two heads: generation must be told where to chain.
    generate("hop", SETTINGS, tmp_path, tag="b1", down_revision="a1_hop_v2_01")
    with pytest.raises(UsageError, match="several heads"):
        generate("hop", SETTINGS, tmp_path, tag="c1")


def test_cli_generate_json_and_one_line_errors(tmp_path: Path) -> None:
    _project(tmp_path, per_migration=True)
    run = [sys.executable, "-m", "outbox_migrate", "alembic", "generate", "--pattern", "hop"]
    done = subprocess.run([*run, "--dir", str(tmp_path), "--format", "json", "--tag", "j1"],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["phase_targets"] == {"V2": "j1_hop_v2_10", "V3": "j1_hop_v3_02"}
    assert doc["revisions"][0]["revision"] == "j1_hop_v2_01"
    missing = subprocess.run([*run, "--dir", str(tmp_path / "nowhere")],
                             capture_output=True, text=True)  # fmt: skip
    assert missing.returncode == 2
    assert missing.stderr.startswith("outbox-migrate: error: no Alembic project in")
    assert len(missing.stderr.strip().splitlines()) == 1


def _versions(root: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in (root / "migrations" / "versions").glob("*.py")}


def _heads(ini: Path) -> list[str]:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(Config(str(ini))).get_heads()


def test_generate_refuses_a_revision_id_that_exists(tmp_path: Path) -> None:
    # A second run with the same tag used to rewrite the reviewed (maybe applied) files and
    # chain the new copy of the first one after the old head: a cycle.
    ini = _project(tmp_path, per_migration=True)
    generate("cop", SETTINGS, tmp_path, tag="q1")
    before = _versions(tmp_path)
    with pytest.raises(UsageError, match=r"revision q1_cop_v2_01 already exists in .* --tag"):
        generate("cop", SETTINGS, tmp_path, tag="q1")
    assert _versions(tmp_path) == before
    assert _heads(ini) == ["q1_cop_v3_02"]
    # The same tag for another pattern makes other ids: chained after the head.
    assert generate("hop", SETTINGS, tmp_path, tag="q1").down_revision == "q1_cop_v3_02"


def test_generate_draws_another_random_tag_when_one_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import outbox_migrate.alembic_ext.generate as generation

    _project(tmp_path, per_migration=True)
    generate("hop", SETTINGS, tmp_path, tag="aaaa")
    drawn = iter(["aaaa", "bbbb"])
    monkeypatch.setattr(generation.secrets, "token_hex", lambda _n: next(drawn))
    result = generate("hop", SETTINGS, tmp_path)
    assert result.revisions[0]["revision"] == "bbbb_hop_v2_01"


def test_generate_refuses_ids_longer_than_alembic_version_holds(tmp_path: Path) -> None:
    # alembic_version.version_num is VARCHAR(32): a longer id is written, then `alembic
    # upgrade` fails on it (StringDataRightTruncation) once the pipeline reaches it.
    _project(tmp_path, per_migration=True)
    with pytest.raises(UsageError, match=r"abcdefghijklmnop_hoper_copy_back_01 \(35 characters\)"
                       r".* 32 .* at most 13"):  # fmt: skip
        generate("hoper", SETTINGS, tmp_path, tag="abcdefghijklmnop")
    with pytest.raises(UsageError, match=r"abcdefghij_hopia_original_name_01 \(33 characters\)"):
        generate("hopia", SETTINGS, tmp_path, tag="abcdefghij", include_optional=True)
    assert _versions(tmp_path) == {}
    # The limit is the ids', not the tag's: a longer tag fits a pattern with shorter ids.
    longest = generate("hoper", SETTINGS, tmp_path, tag="abcdefghijklm")
    assert max(len(r["revision"]) for r in longest.revisions) == 32
    phases = generate("hoper", SETTINGS, tmp_path, tag="abcdefghijklmnop", split=Split.PHASE)
    assert phases.revisions[-1]["revision"] == "abcdefghijklmnop_hoper_copy_back"


def _cycle(root: Path) -> None:
    """Hand-edit the first revision to revise the last one: a history Alembic cannot read."""
    first = next((root / "migrations" / "versions").glob("c1_hop_v2_01_*.py"))
    first.write_text(first.read_text().replace(
        "down_revision: Union[str, Sequence[str], None] = None",
        "down_revision: Union[str, Sequence[str], None] = 'c1_hop_v3_02'",
    ))  # fmt: skip


def test_cli_generate_refusals_are_one_line_exit_2(tmp_path: Path) -> None:
    _project(tmp_path, per_migration=True)
    run = [sys.executable, "-m", "outbox_migrate", "alembic", "generate", "--pattern", "hop",
           "--dir", str(tmp_path)]  # fmt: skip
    assert subprocess.run([*run, "--tag", "c1"], capture_output=True).returncode == 0
    before = _versions(tmp_path)

    def refused(*args: str) -> str:
        done = subprocess.run([*run, *args], capture_output=True, text=True)
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("outbox-migrate: error: "), done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "internal error" not in done.stderr
        assert _versions(tmp_path) == before
        return done.stderr

    assert "c1_hop_v2_01 already exists" in refused("--tag", "c1")
    assert "32" in refused("--tag", "a" * 23)
    assert "--down-revision 'nosuch'" in refused("--down-revision", "nosuch", "--tag", "d1")
    _cycle(tmp_path)
    before = _versions(tmp_path)
    assert "history" in refused("--down-revision", "c1_hop_v2_05", "--tag", "d1")
    assert "history" in refused("--tag", "d1")


def test_revisions_pin_the_guard_whatever_the_environment_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Generated with the guard on (the default), applied where the environment turns it off
    # (OUTBOX_MIGRATE_UNPUBLISHED_GUARD=off, an outbox-migrate.toml in CI's cwd): V2 used to
    # stop half-way, "pattern HOPER has no step 'hoper.v2.guard-unpublished'".
    ini = _project(tmp_path, per_migration=True)
    result = generate("hoper", SETTINGS, tmp_path, tag="g1")
    assert all(
        "'unpublished_guard': True," in Path(r["path"]).read_text() for r in result.revisions
    )
    monkeypatch.setenv("OUTBOX_MIGRATE_UNPUBLISHED_GUARD", "off")
    assert 'CREATE TRIGGER "outbox_unpublished_guard"' in _sql(ini, "g1_hoper_v2_10")
    # Generated off, it stays off where the environment says nothing.
    monkeypatch.delenv("OUTBOX_MIGRATE_UNPUBLISHED_GUARD")
    off = generate("hoper", load_settings({"unpublished_guard": False}, environ={}), tmp_path,
                   tag="g2", down_revision="base")  # fmt: skip
    assert len(off.revisions) == len(result.revisions) - 1
    assert "unpublished_guard" not in _sql(ini, f"base:{off.phase_targets['V2']}")


def test_revisions_generated_before_the_guard_was_pinned_keep_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Earlier versions left the key out when the guard was on: such a revision means "on".
    ini = _project(tmp_path, per_migration=True)
    for revision in generate("hop", SETTINGS, tmp_path, tag="o1").revisions:
        path = Path(revision["path"])
        path.write_text(path.read_text().replace("'unpublished_guard': True,", ""))
    monkeypatch.setenv("OUTBOX_MIGRATE_UNPUBLISHED_GUARD", "off")
    assert 'CREATE TRIGGER "outbox_unpublished_guard"' in _sql(ini, "o1_hop_v2_10")


def test_interrupt_under_the_alembic_command_is_one_failed_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from alembic.config import main as alembic_main

    from outbox_migrate.alembic_ext import execute

    ini = _project(tmp_path, per_migration=True)
    generate("hop", SETTINGS, tmp_path, tag="i1")

    def interrupted(*_args: object, **_kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(execute, "apply_steps", interrupted)
    ini.write_text(
        re.sub(r"(?m)^sqlalchemy\.url = .*$", f"sqlalchemy.url = {URL}", ini.read_text())
    )
    with pytest.raises(SystemExit) as exited:
        alembic_main(["-c", str(ini), "upgrade", "i1_hop_v2_01", "--sql"])
    assert exited.value.code == -1  # Alembic's own exit for a FAILED line
    failed = [line for line in capsys.readouterr().out.splitlines() if "FAILED" in line]
    assert failed == [
        "FAILED: interrupted (Ctrl-C) during step hop.v2.create-partitioned-table; "
        "alembic_version does not record this revision and the ledger keeps every step that "
        "completed — re-run the same `alembic` command to continue"
    ]
    # Called from Python (command.upgrade), the KeyboardInterrupt is left as it is.
    with pytest.raises(KeyboardInterrupt):
        _sql(ini, "i1_hop_v2_01")
