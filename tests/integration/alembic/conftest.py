"""Fixtures for the Alembic tests: a fresh `alembic init` project (not the repository's
example) with one application revision; `other_dsn`, a second database for offline SQL."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from alembic import command
from alembic.config import Config

from tests.support.alembic_project import GATE_ENV, other_dsn  # noqa: F401 - fixture

APP_REVISION = "app0001"


def _init(root: Path, *, per_migration: bool) -> Path:
    ini = root / "alembic.ini"
    config = Config(str(ini), stdout=io.StringIO())
    command.init(config, str(root / "migrations"))
    if per_migration:
        env = root / "migrations" / "env.py"
        text = env.read_text()
        env.write_text(
            text.replace(
                "target_metadata=target_metadata",
                "target_metadata=target_metadata, transaction_per_migration=True",
            )
        )
    command.revision(Config(str(ini), stdout=io.StringIO()), "application schema",
                     rev_id=APP_REVISION)  # fmt: skip
    return ini


@pytest.fixture
def gate_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in GATE_ENV.items():
        monkeypatch.setenv(key, value)


@pytest.fixture
def project(tmp_path: Path, gate_env: None) -> Path:
    """`alembic init` as generated: one transaction around the whole upgrade."""
    return _init(tmp_path, per_migration=False)


@pytest.fixture
def project_per_migration(tmp_path: Path, gate_env: None) -> Path:
    """`alembic init` with `transaction_per_migration=True` (what docs/alembic.md advises)."""
    return _init(tmp_path, per_migration=True)
