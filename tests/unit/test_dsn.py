"""DSN resolution and password masking."""

from __future__ import annotations

import pytest

from outbox_migrate.db import one_line
from outbox_migrate.dsn import mask, resolve


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("postgresql://app:s3cret@db:5432/app", "postgresql://app:****@db:5432/app"),
        (
            "postgres://app:s3cret@db/app?sslmode=require",
            "postgres://app:****@db/app?sslmode=require",
        ),
        (
            "host=db user=app password=s3cret dbname=app",
            "host=db user=app password=**** dbname=app",
        ),
        ("host=db password='s3 cret' dbname=app", "host=db password=**** dbname=app"),
        ("postgresql://db/app?user=x&password=s3cret", "postgresql://db/app?user=x&password=****"),
        ("postgresql://app@db/app", "postgresql://app@db/app"),
    ],
)
def test_mask(raw: str, expected: str) -> None:
    assert mask(raw) == expected
    assert "s3cret" not in mask(raw)


def test_mask_removes_extra_secrets_verbatim() -> None:
    assert mask("server said hunter22 twice: hunter22", "hunter22") == (
        "server said **** twice: ****"
    )


def test_resolve_precedence() -> None:
    env = {"OUTBOX_MIGRATE_DSN": "from-env", "PGHOST": "pg"}
    assert resolve("flag", env) is not None and resolve("flag", env).dsn == "flag"  # type: ignore[union-attr]
    resolved = resolve(None, env)
    assert resolved is not None and resolved.source == "OUTBOX_MIGRATE_DSN"
    libpq = resolve(None, {"PGHOST": "pg"})
    assert libpq is not None and libpq.dsn == "" and "PG*" in libpq.source
    assert resolve(None, {}) is None


def test_one_line_strips_libpq_prefixes_and_password() -> None:
    message = (
        'connection failed: connection to server at "127.0.0.1", port 5432 failed: '
        'FATAL:  password authentication failed for user "app"\n'
        "connection to server at ... second attempt"
    )
    assert one_line(message, "password=s3cret") == ('password authentication failed for user "app"')


def test_the_sqlalchemy_url_alembic_keeps_is_accepted_and_its_password_masked() -> None:
    """docs/alembic.md keeps one `postgresql+psycopg://` DATABASE_URL and passes it to
    `--dsn`: libpq refused it and the error printed the password, twice."""
    url = "postgresql+psycopg://owner:S3cretPW@127.0.0.1:5432/app"
    resolved = resolve(url, {})
    assert resolved is not None and resolved.dsn == "postgresql://owner:S3cretPW@127.0.0.1:5432/app"
    env = resolve(None, {"OUTBOX_MIGRATE_DSN": "postgres+psycopg2://o@h/d"})
    assert env is not None and env.dsn == "postgres://o@h/d"
    shown = mask(f'missing "=" after "{url}" in connection info string')
    assert "S3cretPW" not in shown and "postgresql+psycopg://owner:****@" in shown
