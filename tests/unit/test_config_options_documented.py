"""docs/configuration.md says which commands take each configuration key; the commands' real
options must say the same (`next --lock-budget-s`, `rollback --lock-timeout-ms` and `run
--old-app-name` were "No such option" while the docs promised every key on every command)."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import typer.main

from outbox_migrate.cli.app import app
from outbox_migrate.config import KEYS, OutboxSpec

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
SECTION = "## Which commands take which key"


def documented() -> dict[str, set[str]]:
    """Key → the commands the docs table lists for it."""
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index(SECTION) :].split("\n## ", 1)[0]
    order = [f.name for f in fields(OutboxSpec)]
    found: dict[str, set[str]] = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        keys_cell, commands_cell = (cell.strip() for cell in line.strip("|").split("|"))
        span = re.fullmatch(r"`(\w+)` to `(\w+)`.*", keys_cell)
        if span:
            keys = order[order.index(span[1]) : order.index(span[2]) + 1]
        else:
            keys = re.findall(r"`(\w+)`", keys_cell)
        commands = set(re.findall(r"`([a-z-]+(?: [a-z-]+)?)`", commands_cell))
        for key in keys:
            found[key] = commands
    return found


def actual() -> dict[str, set[str]]:
    """Key → the commands that have `--key-name` as an option, from the click objects typer
    builds (sub-groups such as `alembic` walked)."""
    options: dict[str, set[str]] = {}

    def walk(command: object, path: str) -> None:
        for name, sub in (getattr(command, "commands", None) or {}).items():
            walk(sub, f"{path} {name}".strip())
        for param in getattr(command, "params", []):
            for opt in getattr(param, "opts", []):
                options.setdefault(opt, set()).add(path)

    walk(typer.main.get_command(app), "")
    return {key: options.get("--" + key.replace("_", "-"), set()) for key in KEYS}


def test_every_key_is_in_the_docs_table() -> None:
    assert set(documented()) == set(KEYS)


def test_the_docs_table_is_what_the_commands_take() -> None:
    docs, real = documented(), actual()
    wrong = {key: (sorted(docs[key]), sorted(real[key])) for key in KEYS if docs[key] != real[key]}
    assert wrong == {}, "key: (documented, actual options)"


def test_on_long_tx_is_on_every_command_that_applies_steps() -> None:
    """Not a configuration key, but the runner's choice for every command that runs steps."""
    group = typer.main.get_command(app)
    for name in ("run", "next", "rollback"):
        opts = {o for p in group.commands[name].params for o in p.opts}  # type: ignore[attr-defined]
        assert "--on-long-tx" in opts, name
