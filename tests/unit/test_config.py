"""Configuration precedence and validation: flags > env > file > defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from outbox_migrate.config import OutboxSpec, load_settings
from outbox_migrate.errors import ConfigError, ExitCode


def test_defaults_are_the_spec_names(tmp_path: Path) -> None:
    settings = load_settings(environ={}, cwd=tmp_path)
    assert settings.spec == OutboxSpec()
    assert settings.spec.table == "outbox"
    assert settings.spec.partitioned_table == "outbox_new"
    assert settings.spec.unpublished_partition == "outbox_unpublished"
    assert settings.spec.published_partition == "outbox_published"
    assert settings.spec.check_name == "outbox_published_check"
    assert settings.spec.unpublished_index == "outbox_new_unpublished_id_idx"


def test_precedence_flag_over_env_over_file(tmp_path: Path) -> None:
    (tmp_path / "outbox-migrate.toml").write_text(
        'table = "from_file"\nschema = "file_schema"\nid_column = "msg_id"\n'
    )
    env = {"OUTBOX_MIGRATE_TABLE": "from_env", "OUTBOX_MIGRATE_SCHEMA": "env_schema"}
    settings = load_settings({"table": "from_flag"}, environ=env, cwd=tmp_path)
    assert settings.spec.table == "from_flag"
    assert settings.spec.schema == "env_schema"
    assert settings.spec.id_column == "msg_id"
    assert settings.sources["table"] == "--table"
    assert settings.sources["schema"] == "OUTBOX_MIGRATE_SCHEMA"
    assert settings.sources["id_column"].endswith("outbox-migrate.toml")


def test_pyproject_tool_table(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\n[tool.outbox-migrate]\ntable = "events"\nlock_timeout_ms = 50\n'
    )
    settings = load_settings(environ={}, cwd=tmp_path)
    assert settings.spec.table == "events"
    assert settings.lock_timeout_ms == 50


def test_dedicated_file_wins_over_pyproject(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[tool.outbox-migrate]\ntable = "py"\n')
    (tmp_path / "outbox-migrate.toml").write_text('table = "dedicated"\n')
    assert load_settings(environ={}, cwd=tmp_path).spec.table == "dedicated"


def test_unknown_file_key_names_key_and_file(tmp_path: Path) -> None:
    (tmp_path / "outbox-migrate.toml").write_text('tabel = "x"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(environ={}, cwd=tmp_path)
    message = str(info.value)
    assert "'tabel'" in message
    assert "outbox-migrate.toml" in message
    assert info.value.exit_code == ExitCode.USAGE


def test_unknown_env_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="OUTBOX_MIGRATE_TABEL"):
        load_settings(environ={"OUTBOX_MIGRATE_TABEL": "x"}, cwd=tmp_path)


def test_non_config_env_vars_are_ignored(tmp_path: Path) -> None:
    env = {"OUTBOX_MIGRATE_DSN": "x", "OUTBOX_MIGRATE_TEST_PG": "14"}
    assert load_settings(environ=env, cwd=tmp_path).spec == OutboxSpec()


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("id_headroom", "-1", "must be positive"),
        ("id_headroom", "lots", "must be an integer"),
        ("lock_budget_s", "0", "must be positive"),
        ("table", "x" * 64, "longer than 63 bytes"),
        ("table", "", "non-empty"),
    ],
)
def test_invalid_values_name_key_and_source(
    tmp_path: Path, key: str, value: str, fragment: str
) -> None:
    env = {f"OUTBOX_MIGRATE_{key.upper()}": value}
    with pytest.raises(ConfigError) as info:
        load_settings(environ=env, cwd=tmp_path)
    assert key in str(info.value)
    assert f"OUTBOX_MIGRATE_{key.upper()}" in str(info.value)
    assert fragment in str(info.value)


def test_relations_need_distinct_names(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="already used"):
        load_settings({"partitioned_table": "outbox"}, environ={}, cwd=tmp_path)


def test_bad_toml_is_reported(tmp_path: Path) -> None:
    (tmp_path / "outbox-migrate.toml").write_text("table = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(environ={}, cwd=tmp_path)


def test_column_roles_from_file_env_and_flags(tmp_path: Path) -> None:
    (tmp_path / "outbox-migrate.toml").write_text(
        'created_column = "occurred_at"\nmetadata_columns = ["trace_id", "tenant_id"]\n'
        'payload_column = "body"\n'
    )
    env = {"OUTBOX_MIGRATE_KEY_COLUMN": "aggregate_id", "OUTBOX_MIGRATE_HEADERS_COLUMN": ""}
    settings = load_settings({"event_type_column": "type"}, environ=env, cwd=tmp_path)
    spec = settings.spec
    assert spec.created_column == "occurred_at"
    assert spec.metadata_columns == ("trace_id", "tenant_id")
    assert spec.payload_column == "body"
    assert spec.key_column == "aggregate_id"
    assert spec.headers_column == ""  # explicitly "no headers column"
    assert spec.event_type_column == "type"


def test_metadata_columns_comma_separated_in_env(tmp_path: Path) -> None:
    env = {"OUTBOX_MIGRATE_METADATA_COLUMNS": "trace_id, tenant_id,"}
    spec = load_settings(environ=env, cwd=tmp_path).spec
    assert spec.metadata_columns == ("trace_id", "tenant_id")


@pytest.mark.parametrize(
    ("values", "fragment"),
    [
        ({"metadata_columns": "id"}, "is the id column"),
        ({"id_kind": "uuid"}, "must be one of database, application"),
        ({"payload_column": ""}, "non-empty"),
        ({"order_column": "created_at"}, "applies to application ids only"),
    ],
)
def test_column_role_errors(tmp_path: Path, values: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        load_settings(values, environ={}, cwd=tmp_path)


def test_order_column_for_application_ids(tmp_path: Path) -> None:
    """The claim order of application ids: the order column, else the id itself."""
    env = {"OUTBOX_MIGRATE_ID_KIND": "application"}
    spec = load_settings(environ=env, cwd=tmp_path).spec
    assert (spec.claim_order, spec.gate_sequence) == ("id", "outbox_gate_seq")
    spec = load_settings({"order_column": "created_at"}, environ=env, cwd=tmp_path).spec
    assert spec.claim_order == "created_at"


def test_unpublished_guard_is_on_by_default_and_off_from_any_source(tmp_path: Path) -> None:
    assert load_settings(environ={}, cwd=tmp_path).spec.unpublished_guard is True
    (tmp_path / "outbox-migrate.toml").write_text("unpublished_guard = false\n")
    assert load_settings(environ={}, cwd=tmp_path).spec.unpublished_guard is False
    env = {"OUTBOX_MIGRATE_UNPUBLISHED_GUARD": "on"}
    assert load_settings(environ=env, cwd=tmp_path).spec.unpublished_guard is True
    flagged = load_settings({"unpublished_guard": "off"}, environ=env, cwd=tmp_path)
    assert flagged.spec.unpublished_guard is False
    with pytest.raises(ConfigError, match=r"unpublished_guard.*must be on or off"):
        load_settings({"unpublished_guard": "maybe"}, environ={}, cwd=tmp_path)
