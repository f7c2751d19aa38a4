"""The hot path's statement form and parameter text (relay/wire.py): no server needed."""

from __future__ import annotations

import pytest

from outbox_migrate.relay.wire import Statement, dump


def test_named_placeholders_become_numbered_in_first_use_order() -> None:
    statement = Statement(
        b"SELECT 1 WHERE id > %(after)s AND mod(id, %(shards)s) = ANY(%(mine)s) "
        b"AND k = %(after)s LIMIT %(limit)s"
    )
    assert statement.text == (
        b"SELECT 1 WHERE id > $1 AND mod(id, $2) = ANY($3) AND k = $1 LIMIT $4"
    )
    assert statement.names == ("after", "shards", "mine", "limit")


def test_a_doubled_percent_is_a_literal_percent() -> None:
    statement = Statement(b"SELECT 'a%%b' LIKE %(p)s")
    assert statement.text == b"SELECT 'a%b' LIKE $1"
    assert statement.names == ("p",)


def test_parameters_as_text() -> None:
    assert dump(None, "utf-8") is None
    assert dump(42, "utf-8") == b"42"
    assert dump(-7, "utf-8") == b"-7"
    assert dump(True, "utf-8") == b"t"
    assert dump([3, 1, 2], "utf-8") == b"{3,1,2}"
    assert dump([], "utf-8") == b"{}"
    assert dump("é", "utf-8") == "é".encode()
    assert dump('{"(0,1)","(0,2)"}', "utf-8") == b'{"(0,1)","(0,2)"}'


def test_a_value_without_a_text_form_is_refused() -> None:
    with pytest.raises(TypeError, match="float"):
        dump(1.5, "utf-8")
    with pytest.raises(TypeError, match="list"):
        dump(["a"], "utf-8")
