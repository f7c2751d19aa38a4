"""The type of an outbox id as the relay carries it: below both the messages and the errors
that name them, so neither imports the other for it."""

from __future__ import annotations

MessageId = int | str
"""A database id (int), or an application id (uuid, ULID) as text."""

__all__ = ["MessageId"]
