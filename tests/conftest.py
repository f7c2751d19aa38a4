"""Shared test configuration; database fixtures live in tests/fixtures/postgres.py."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _logging_restored() -> Iterator[None]:
    """Undo what the generated env.py's `fileConfig(...)` does to this process's logging.

    Alembic's `alembic init` template (the Alembic tests use a fresh one) calls fileConfig
    with disable_existing_loggers=True, which disables every logger that exists at that
    moment — outbox_migrate's among them — and replaces the root handlers. That is the user's choice in their own process; in the test process it
    silenced the relay's logger for every later test (a relay logging test failed only after
    these tests had run).
    """
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    disabled = {
        name: logger.disabled
        for name, logger in root.manager.loggerDict.items()
        if isinstance(logger, logging.Logger)
    }
    try:
        yield
    finally:
        for name, logger in list(root.manager.loggerDict.items()):
            if isinstance(logger, logging.Logger):
                logger.disabled = disabled.get(name, False)
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)
        for handler in handlers:
            if handler not in root.handlers:
                root.addHandler(handler)
        root.setLevel(level)


# Tests that share a machine-wide resource run on one xdist worker, one after another: the
# multi-host bed numbers its namespaces' addresses from 10.77.1.0 whatever the process, and
# the embedded server (the README's demo, the help examples) keeps one data directory per
# user. Everything else owns what it touches (a fresh database, uuid-named broker queues).
_SERIAL_GROUPS = {
    "tests/netns/": "netns",
    "tests/e2e/test_demo_under_load.py": "embedded",
    "tests/e2e/test_help_examples.py": "embedded",
    "tests/unit/test_readme_quickstart.py": "embedded",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        for prefix, group in _SERIAL_GROUPS.items():
            if path.startswith(prefix):
                item.add_marker(pytest.mark.xdist_group(group))
