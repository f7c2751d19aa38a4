"""Which broker errors reject one message and which are outages (the classification tables in
docs/sinks.md), on the client libraries' own error objects; no broker needed."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    ("code", "permanent"),
    [
        ("MSG_SIZE_TOO_LARGE", True), ("INVALID_RECORD", True),
        ("TOPIC_AUTHORIZATION_FAILED", True), ("_UNKNOWN_TOPIC", True),
        ("UNKNOWN_TOPIC_OR_PART", True), ("_MSG_TIMED_OUT", False), ("_TRANSPORT", False),
        ("NOT_LEADER_FOR_PARTITION", False), ("_ALL_BROKERS_DOWN", False),
    ],
)  # fmt: skip
def test_kafka_classification(code: str, permanent: bool) -> None:
    confluent_kafka = pytest.importorskip("confluent_kafka")
    from outbox_migrate.relay.sinks.kafka import is_permanent

    error = confluent_kafka.KafkaError(getattr(confluent_kafka.KafkaError, code))
    assert is_permanent(error) is permanent


def test_kafka_fatal_errors_are_never_per_message() -> None:
    confluent_kafka = pytest.importorskip("confluent_kafka")
    from outbox_migrate.relay.sinks.kafka import is_permanent

    error = confluent_kafka.KafkaError(confluent_kafka.KafkaError.INVALID_RECORD, fatal=True)
    assert not is_permanent(error)


@pytest.mark.parametrize(
    ("reply", "permanent"),
    [
        ("WRONGTYPE Operation against a key holding the wrong kind of value", True),
        ("NOPERM User outbox has no permissions to access the 'x' key", True),
        ("ERR The ID specified in XADD is equal or smaller than the target stream top item", True),
        ("OOM command not allowed when used memory > 'maxmemory'.", False),
        ("LOADING Redis is loading the dataset in memory", False),
        ("READONLY You can't write against a read only replica.", False),
        ("MISCONF Redis is configured to save RDB snapshots", False),
    ],
)
def test_redis_classification(reply: str, permanent: bool) -> None:
    """As a plain ResponseError and as redis-py's parser hands the reply over: a class of its
    own for OOM, LOADING, READONLY …, with the code cut off the text."""
    redis = pytest.importorskip("redis")
    from redis.connection import DefaultParser

    from outbox_migrate.relay.sinks.redis import is_permanent_reply

    assert is_permanent_reply(redis.ResponseError(reply)) is permanent
    assert is_permanent_reply(DefaultParser.parse_error(reply)) is permanent


def test_nats_classification() -> None:
    pytest.importorskip("nats")
    from nats.errors import ConnectionClosedError, MaxPayloadError, TimeoutError
    from nats.js.errors import APIError, NoStreamResponseError, ServiceUnavailableError

    from outbox_migrate.relay.sinks.nats import is_permanent

    assert is_permanent(MaxPayloadError()) and is_permanent(NoStreamResponseError())
    assert is_permanent(APIError(code=400, err_code=10054, description="message size exceeds"))
    assert not is_permanent(ServiceUnavailableError(code=503))
    assert not is_permanent(TimeoutError()) and not is_permanent(ConnectionClosedError())
