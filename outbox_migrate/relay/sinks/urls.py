"""Sink URL checks at construction: a wrong scheme stops the relay at start (exit 2) rather
than being retried for ever as "sink unavailable"."""

from __future__ import annotations

import re
from collections.abc import Sequence
from urllib.parse import urlsplit

from outbox_migrate.dsn import mask
from outbox_migrate.errors import RelayError

_URL_PASSWORD = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*:)[^@\s]*(?P<tail>@)")


def mask_url(text: str) -> str:
    """`mask` for any URL scheme (amqp://, redis://, nats://, …), not only PostgreSQL's: the
    password between `user:` and `@` becomes `****`."""
    return mask(_URL_PASSWORD.sub(lambda m: f"{m['head']}****{m['tail']}", text))


def require_scheme(
    sink: str, url: str | None, schemes: Sequence[str], *, bare: bool = False
) -> str | None:
    """`url` (None = the sink's default) if its scheme is one of `schemes`, else RelayError.
    `bare=True` (Kafka): a `host:port` list is accepted too, and URLs come back as one, which
    is what librdkafka reads as bootstrap servers."""
    if url is None or not url.strip():
        return None
    if bare and "://" not in url:
        return url
    parts = [urlsplit(u.strip()) for u in url.split(",")] if bare else [urlsplit(url)]
    for part in parts:
        if part.scheme.lower() not in schemes:
            raise RelayError(
                f"sink {sink}: URL scheme {part.scheme or '(none)'!r} in {mask_url(url)!r} is not "
                f"one of {', '.join(s + '://' for s in schemes)}"
            )
        if not part.netloc and part.scheme.lower() != "unix":
            raise RelayError(f"sink {sink}: {mask_url(url)!r} names no host")
    if bare:
        return ",".join(p.netloc for p in parts)
    return url
