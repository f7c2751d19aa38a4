"""outbox-migrate: move a live PostgreSQL outbox to a LIST-partitioned table, then run it.

Importing the package must stay cheap: the CLI loads it before it can install its signal
handlers, so nothing here may import psycopg, rich, SQLAlchemy — or even importlib.metadata
(~60 ms) or functools: `__version__` is looked up on first use.
"""

from __future__ import annotations

__all__ = ["__version__"]

_version: list[str] = []


def __getattr__(name: str) -> str:
    """`outbox_migrate.__version__`, resolved lazily (see the module docstring)."""
    if name != "__version__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not _version:
        from importlib.metadata import PackageNotFoundError, version

        try:
            _version.append(version("outbox-migrate"))
        except PackageNotFoundError:  # pragma: no cover - a source tree without install
            _version.append("0.0.0+unknown")
    return _version[0]
