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


def bad_url(sink: str, url: str, exc: Exception) -> RelayError:
    """The one-line error for a URL its parser refused, the password masked in both."""
    return RelayError(f"sink {sink}: bad URL {mask_url(url)!r}: {mask_url(str(exc))}")


def require_scheme(
    sink: str, url: str | None, schemes: Sequence[str], *, bare: bool = False
) -> str | None:
    """`url` (None = the sink's default) if its scheme is one of `schemes`, else RelayError.
    `bare=True` (Kafka): a `host:port` list is accepted too, and URLs come back as one, which
    is what librdkafka reads as bootstrap servers."""
    if url is None or not url.strip():
        return None
    listed = bare and "://" not in url
    try:
        if listed:
            parts = [urlsplit("//" + u.strip()) for u in url.split(",")]
        else:
            parts = [urlsplit(u.strip()) for u in url.split(",")] if bare else [urlsplit(url)]
        for part in parts:
            _ = part.port  # a port that is not a number in 0-65535 raises here, not at connect
    except ValueError as exc:
        raise bad_url(sink, url, exc) from None
    if listed:
        return url
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
