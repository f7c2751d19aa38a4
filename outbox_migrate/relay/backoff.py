"""The relay's retry delays: the tool's one backoff function (`outbox_migrate.backoff`)."""

from outbox_migrate.backoff import (
    BACKOFF_BASE_S,
    BACKOFF_CAP_S,
    SERIALIZATION_RETRY_MAX_S,
    backoff_s,
    jitter_s,
)

__all__ = ["BACKOFF_BASE_S", "BACKOFF_CAP_S", "SERIALIZATION_RETRY_MAX_S", "backoff_s", "jitter_s"]
