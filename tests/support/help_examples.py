"""The `Example:` paragraphs of the CLI's help as a user sees and pastes them."""

from __future__ import annotations

import re
from collections.abc import Iterator

_BLOCK = re.compile(r"^( *)Example:\n((?:\1  +\S.*\n?)+)", re.M)


def rendered_helps() -> Iterator[tuple[str, str]]:
    """(command path, its `--help` as rendered at 80 columns) for every command."""
    from typer import Context
    from typer.main import get_command

    from outbox_migrate.cli.app import app

    root = get_command(app)
    pending = [(root, Context(root, info_name="outbox-migrate", terminal_width=80))]
    while pending:
        command, ctx = pending.pop()
        yield ctx.command_path, command.get_help(ctx)
        for name, sub in getattr(command, "commands", {}).items():
            pending.append((sub, Context(sub, info_name=name, parent=ctx)))


def example_blocks(help_text: str) -> list[list[str]]:
    """The lines of each `Example:` paragraph, as printed."""
    return [block.rstrip("\n").split("\n") for _indent, block in _BLOCK.findall(help_text)]


def pasted(lines: list[str]) -> str:
    """One example as the shell reads it once pasted: ` \\` continuations joined."""
    return re.sub(r"\s*\\\n\s*", " ", "\n".join(lines)).strip()
