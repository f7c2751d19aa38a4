"""Finding the DSN the user meant, and masking its password wherever it could be shown. No
connection is made here; psycopg is imported lazily to keep the `--help` path light.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

EMBEDDED = "embedded"
"""The DSN value that asks for the embedded PostgreSQL (see `outbox_migrate.embedded`)."""

DSN_ENV = "OUTBOX_MIGRATE_DSN"
MASK = "****"

_URI_PASSWORD = re.compile(
    r"(?P<head>postgres(?:ql)?(?:\+\w+)?://[^:/@\s]*:)(?P<pw>[^@\s]*)(?P<tail>@)"
)
_SQLALCHEMY_DRIVER = re.compile(r"^\s*(?P<scheme>postgres(?:ql)?)\+\w+://")
_KV_PASSWORD = re.compile(r"(?P<head>\bpassword\s*=\s*)(?P<pw>'(?:[^'\\]|\\.)*'|\S+)", re.I)
_QUERY_PASSWORD = re.compile(r"(?P<head>[?&]password=)(?P<pw>[^&\s]*)", re.I)


@dataclass(frozen=True)
class ResolvedDsn:
    """A DSN and where it came from (for error messages that name the source)."""

    dsn: str
    source: str


def resolve(flag: str | None, environ: Mapping[str, str] | None = None) -> ResolvedDsn | None:
    """Pick the DSN: `--dsn` > `OUTBOX_MIGRATE_DSN` > libpq's `PG*` variables.

    Returns ``None`` when nothing names a database, so commands that can work offline (like
    `plan` without introspection) know to do so. An empty DSN means "libpq defaults": psycopg
    then reads PGHOST, PGPORT, PGUSER, PGPASSWORD, PGDATABASE, PGSERVICE itself.
    """
    env = os.environ if environ is None else environ
    if flag:
        return ResolvedDsn(libpq_form(flag), "--dsn")
    if env.get(DSN_ENV):
        return ResolvedDsn(libpq_form(env[DSN_ENV]), DSN_ENV)
    if any(env.get(k) for k in ("PGHOST", "PGDATABASE", "PGSERVICE", "PGPORT", "PGUSER")):
        return ResolvedDsn("", "PG* environment variables")
    return None


def libpq_form(dsn: str) -> str:
    """`dsn` with a SQLAlchemy driver suffix dropped (`postgresql+psycopg://` → `postgresql://`):
    the Alembic setup keeps one URL in DATABASE_URL, and libpq refuses the suffixed form."""
    return _SQLALCHEMY_DRIVER.sub(lambda m: f"{m['scheme']}://", dsn, count=1)


def mask(text: str, *secrets: str) -> str:
    """Replace every password in `text` (URI, key=value or query form) with `****`.

    Extra `secrets` (e.g. the password psycopg parsed from the DSN or PGPASSWORD) are removed
    verbatim too, so a server message that echoes one cannot leak it.
    """
    out = _URI_PASSWORD.sub(lambda m: f"{m['head']}{MASK}{m['tail']}", text)
    out = _KV_PASSWORD.sub(lambda m: f"{m['head']}{MASK}", out)
    out = _QUERY_PASSWORD.sub(lambda m: f"{m['head']}{MASK}", out)
    for secret in secrets:
        if secret and len(secret) >= 3:
            out = out.replace(secret, MASK)
    return out


def password_of(dsn: str) -> str | None:
    """The password a DSN carries (or PGPASSWORD), so messages can be scrubbed of it."""
    if dsn and dsn != EMBEDDED:
        from psycopg import ProgrammingError
        from psycopg.conninfo import conninfo_to_dict

        # A malformed DSN is reported by connect(), not here.
        with contextlib.suppress(ProgrammingError):
            value = conninfo_to_dict(dsn).get("password")
            if value:
                return str(value)
    return os.environ.get("PGPASSWORD") or None
