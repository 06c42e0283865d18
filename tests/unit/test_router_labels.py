"""The router relays a worker's reply as its bytes with ``worker`` and ``weight_epoch``
spliced in: the bytes must read exactly as the reply updated with those fields."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.router.app import render
from weightsync.router.forwarding import labelled

FIELDS = {"worker": "http://127.0.0.1:8001", "weight_epoch": 3}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)
replies = st.dictionaries(st.text(), json_values, max_size=5)
styles = st.sampled_from([
    {"separators": (",", ":")}, {"ensure_ascii": False}, {"indent": 2}, {"separators": (", ", ": ")},
])  # fmt: skip


def relayed(raw: bytes, fields: dict[str, Any] = FIELDS) -> tuple[Any, bytes | None]:
    answer = labelled(200, json.loads(raw), raw, dict(fields))
    return json.loads(render(answer).body), answer.raw


def expected(reply: dict[str, Any], fields: dict[str, Any] = FIELDS) -> dict[str, Any]:
    out = dict(reply)
    out.update(fields)
    return out


@settings(max_examples=200)
@given(reply=replies, style=styles, trailing=st.sampled_from(["", " ", "\n", "\r\n\t "]))
def test_a_spliced_reply_reads_as_the_reply_with_the_routers_fields_last(
    reply: dict[str, Any], style: dict[str, Any], trailing: str
) -> None:
    reply = {k: v for k, v in reply.items() if k not in FIELDS}
    raw = (json.dumps(reply, **style) + trailing).encode()
    body, spliced = relayed(raw)
    assert spliced is not None  # the fast path was taken: no second dump
    assert body == expected(reply)
    assert list(body) == list(expected(reply))  # the fields come last, as an update puts them


def test_an_empty_object_gets_the_fields_without_a_stray_comma() -> None:
    for raw in (b"{}", b"{ }", b" {\n}\n"):
        body, spliced = relayed(raw)
        assert spliced is not None and body == FIELDS


def test_a_reply_that_already_names_a_field_is_overwritten_in_place_as_before() -> None:
    raw = b'{"worker":"http://elsewhere:1","text":"hi","weight_epoch":null}'
    body, spliced = relayed(raw)
    assert spliced is None  # dumped again: a splice would repeat the keys
    assert body == {"worker": FIELDS["worker"], "text": "hi", "weight_epoch": 3}
    assert list(body) == ["worker", "text", "weight_epoch"]


def test_a_reply_not_in_plain_utf8_is_dumped_again() -> None:
    reply = {"text": "EEESҿkE", "weight_version": "v0"}
    for raw in (
        json.dumps(reply).encode("utf-16"),
        json.dumps(reply).encode("utf-32-le"),
        b"\xef\xbb\xbf" + json.dumps(reply).encode(),
    ):
        body, spliced = relayed(raw)
        assert spliced is None
        assert body == expected(reply)


def test_an_error_reply_gets_only_the_worker() -> None:
    raw = b'{"status":"error","code":"not_paused","message":"x"}'
    answer = labelled(409, json.loads(raw), raw, {"worker": FIELDS["worker"]})
    assert answer.status == 409
    assert json.loads(render(answer).body) == {
        "status": "error", "code": "not_paused", "message": "x", "worker": FIELDS["worker"],
    }  # fmt: skip
