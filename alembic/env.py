"""Alembic environment of the example project.

Two choices matter for outbox-migrate's revisions: the psycopg 3 driver (its operations run
through the runner on Alembic's own connection), and `transaction_per_migration=True`, so each
generated revision — one step — commits together with its alembic_version update, online and
in `--sql` output alike.
"""

from __future__ import annotations

import os
from logging.config import fileConfig

from alembic import context
from sqlalchemy import engine_from_config, pool

config = context.config
if config.config_file_name is not None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def database_url() -> str:
    """$DATABASE_URL (a libpq-style postgresql:// URL is fine), else alembic.ini's."""
    url = os.environ.get("DATABASE_URL") or config.get_main_option("sqlalchemy.url") or ""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def run_migrations_offline() -> None:
    """`alembic upgrade A:B --sql`: emit SQL for psql, no database connection."""
    context.configure(
        url=database_url(),
        target_metadata=None,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        transaction_per_migration=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    section = config.get_section(config.config_ini_section, {})
    section["sqlalchemy.url"] = database_url()
    connectable = engine_from_config(section, prefix="sqlalchemy.", poolclass=pool.NullPool)
    with connectable.connect() as connection:
        context.configure(
            connection=connection, target_metadata=None, transaction_per_migration=True
        )
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
