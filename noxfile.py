"""nox: the single entry point for checks. `nox -s ci` is what CI (and the README) runs."""

from __future__ import annotations

import os

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "typecheck", "tests"]

ALL_PG = "14,15,16,17,18"
EXTRAS = ".[dev,embedded,demo,kafka,rabbitmq,nats,redis,http,metrics,test-brokers]"


def _install(session: nox.Session) -> None:
    session.install("-e", EXTRAS)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on the package."""
    _install(session)
    session.run("mypy", "--strict", "outbox_migrate")


@nox.session
def tests(session: nox.Session) -> None:
    """pytest on real PostgreSQL; versions from OUTBOX_MIGRATE_TEST_PG (default: newest)."""
    _install(session)
    session.run("pytest", *session.posargs)


@nox.session
def ci(session: nox.Session) -> None:
    """Everything CI checks, in one virtualenv: lint, types, the suite on PostgreSQL 14-18."""
    _install(session)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy", "--strict", "outbox_migrate")
    env = {"OUTBOX_MIGRATE_TEST_PG": os.environ.get("OUTBOX_MIGRATE_TEST_PG", ALL_PG)}
    session.run("pytest", "-p", "no:cacheprovider", *session.posargs, env=env)


@nox.session
def regenerate(session: nox.Session) -> None:
    """Rewrite derived files from the catalog: plan golden output and playbooks/*.md."""
    _install(session)
    session.run("python", "-m", "tests.golden.regenerate")
