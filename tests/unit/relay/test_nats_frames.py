"""The NATS sink writes HPUB frames itself: they must be the bytes nats-py's own `publish`
would send, and the batch's acks must settle each message once, ignoring an earlier batch's."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.errors import BadHeaderError
from nats.js.errors import BadRequestError, NoStreamResponseError

from outbox_migrate.errors import RelayError
from outbox_migrate.relay.message import Message
from outbox_migrate.relay.sinks import NotSent, SinkConfig
from outbox_migrate.relay.sinks.nats import (
    NO_RESPONDERS,
    NatsSink,
    _Acks,
    header_block,
    hpub_frame,
)

TOKEN = st.text("!#$%&'*+-.^_`|~0123456789azAZ", min_size=1, max_size=12)
NAMES = st.builds(lambda pad, name, tail: pad + name + tail, st.sampled_from(["", " "]), TOKEN,
                  st.sampled_from(["", "\t"])) | st.sampled_from([" ", ""])  # fmt: skip
"""Header names as nats-py takes them: blanks around a token, or nothing (skipped)."""
VALUES = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)


def nats_py_frame(subject: str, reply: str, body: bytes, headers: dict[str, str]) -> bytes:
    """What nats-py's publish hands its writer for this message."""
    sent: list[bytes] = []
    nc = Client()

    async def capture(cmd: bytes, priority: bool = False) -> None:
        sent.append(cmd)

    nc._send_command = capture  # type: ignore[method-assign]
    nc._flush_queue = None
    asyncio.run(nc._send_publish(subject, reply, body, len(body), headers))
    (frame,) = sent
    return frame


@given(headers=st.dictionaries(NAMES, VALUES, max_size=5), body=st.binary(max_size=64))
def test_frames_are_the_bytes_nats_py_sends(headers: dict[str, str], body: bytes) -> None:
    ours = hpub_frame(b"orders.created", b"_INBOX.abc.7.12", header_block(headers), body)
    assert ours == nats_py_frame("orders.created", "_INBOX.abc.7.12", body, headers)


def test_a_line_break_in_a_value_cannot_start_a_header_of_its_own() -> None:
    block = header_block({"event-type": "a\r\nNats-Msg-Id: 1", "outbox-id": "7"})
    assert block == b"NATS/1.0\r\nevent-type: a  Nats-Msg-Id: 1\r\noutbox-id: 7\r\n\r\n"


def sink(max_payload: int = 1024 * 1024) -> NatsSink:
    built = NatsSink(SinkConfig(url="nats://127.0.0.1:1", target="orders"))
    built._max_payload = max_payload
    return built


def message(id: int, payload: str = '{"n": 1}', extra: tuple[tuple[str, str], ...] = ()) -> Message:
    return Message(id, "public.outbox", "order.created", None, payload, "2026-01-01T00:00:00Z",
                   extra_headers=extra)  # fmt: skip


def test_a_header_name_nats_cannot_carry_is_that_messages_refusal() -> None:
    built = sink()
    try:
        with pytest.raises(NotSent, match="BadHeaderError"):
            built._build(message(1, extra=(("bad name", "x"),)))
        block, _body = built._build(message(2, extra=(("tenant", "x"),)))
        assert b"tenant: x\r\n" in block and b"Nats-Msg-Id: 2\r\n" in block
    finally:
        built.close()


def test_body_and_header_block_are_counted_against_max_payload() -> None:
    payload = '{"pad": "' + "x" * 400 + '"}'
    built = sink()
    try:
        block, body = built._build(message(1, payload))
        built._max_payload = len(block) + len(body)
        assert built._build(message(1, payload))  # exactly at the limit: sent
        built._max_payload -= 1
        with pytest.raises(NotSent, match="max_payload, headers included"):
            built._build(message(1, payload))
    finally:
        built.close()


class Reply:
    def __init__(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> None:
        self.subject, self.data, self.headers = subject, data, headers


def test_acks_settle_each_message_once_and_ignore_an_earlier_batch() -> None:
    loop = asyncio.new_event_loop()
    try:
        acks = _Acks("_INBOX.x")
        first = acks.expect([message(1), message(2)], loop)
        stale = acks.prefix.decode()
        assert not first.done()
        batch = [message(3), message(4), message(5), message(6)]
        done = acks.expect(batch, loop)
        prefix = acks.prefix.decode()

        def reply(subject: str, data: bytes, headers: dict[str, str] | None = None) -> None:
            loop.run_until_complete(acks.on_reply(Reply(subject, data, headers)))

        reply(f"{stale}0", b'{"stream":"S","seq":1}')  # the batch given up on: ignored
        reply(f"{prefix}0", b'{"stream":"error","seq":9}')  # a stream named "error"
        reply(f"{prefix}0", b'{"error":{"code":400}}')  # a second ack must not count
        reply(f"{prefix}1", b'{"stream":"S","seq":8,"duplicate":true}')
        err = b'{"error":{"code":400,"err_code":10054,"description":"message size exceeds"}}'
        reply(f"{prefix}2", err)
        assert not done.done()
        reply(f"{prefix}3", b"", {"Status": NO_RESPONDERS})
        outcomes: list[tuple[Message, Any]] = done.result()
        assert [m.id for m, _ in outcomes] == [3, 4, 5, 6]
        assert outcomes[0][1] is False and outcomes[1][1] is True
        assert isinstance(outcomes[2][1], BadRequestError)
        assert isinstance(outcomes[3][1], NoStreamResponseError)
        assert not first.done()
    finally:
        loop.close()


def test_an_empty_batch_waits_for_nothing() -> None:
    loop = asyncio.new_event_loop()
    try:
        assert _Acks("_INBOX.y").expect([], loop).result() == []
    finally:
        loop.close()


def test_bad_header_error_is_what_nats_py_raises() -> None:
    with pytest.raises(BadHeaderError):
        header_block({"bad name": "x"})


@pytest.mark.parametrize(
    "target", ["", "orders created", "orders\r\nPUB x 1", "orders.*", "a..b", ">"]
)
def test_a_subject_the_frames_cannot_carry_is_refused_when_the_sink_is_built(target: str) -> None:
    """Written into every frame as it is: a line break would inject protocol lines."""
    with pytest.raises(RelayError, match="not a subject to publish to") as raised:
        NatsSink(SinkConfig(url="nats://127.0.0.1:1", target=target))
    assert "\n" not in str(raised.value)  # one line, whatever the target holds


def test_a_subject_with_dashes_and_unicode_is_fine() -> None:
    built = NatsSink(SinkConfig(url="nats://127.0.0.1:1", target="orders-v2.créé"))
    built.close()
    assert built.subject == "orders-v2.créé"
