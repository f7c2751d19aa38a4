"""The README's first command says, next to it, what it does to the system when run as root
(a system user, a data directory left under /var/lib): it was said only in configuration.md."""

from __future__ import annotations

from pathlib import Path

from outbox_migrate.embedded import DIR_ENV, ROOT_DATA_DIR

README = Path(__file__).resolve().parents[2] / "README.md"


def test_quickstart_names_the_root_side_effects() -> None:
    text = README.read_text(encoding="utf-8")
    quickstart = text[text.index("## Quickstart") :].split("\n## ", 1)[0]
    command = quickstart.index("outbox-migrate demo")
    said = quickstart[command:]
    for fact in ("root", "`pgserver`", str(ROOT_DATA_DIR), DIR_ENV):
        assert fact in said, fact
