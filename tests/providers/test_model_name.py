"""The model a request names: a cheap scan when the body starts with it, one parse otherwise, or the path."""

from __future__ import annotations

import json

import pytest

from proxy.providers.model_name import request_model


@pytest.mark.parametrize(("body", "model"), [
    (b'{"model":"claude-opus-4","messages":[]}', "claude-opus-4"),
    (b' {\n  "model" : "gpt-5",\n "stream": true}', "gpt-5"),
    (json.dumps({"messages": [{"model": "inner"}], "model": "gpt-4o"}).encode(), "gpt-4o"),
    (b'{"model":"a\\u00e9b"}', "a\u00e9b"),
    (b'{"messages":[]}', None),
    (b'{"model": 5}', None),
    (b"not json", None),
    (b"", None),
])
def test_the_body_model(body: bytes, model: str | None) -> None:
    assert request_model("v1/messages", body) == model


def test_a_large_body_that_starts_with_its_model_is_not_parsed() -> None:
    body = b'{"model":"claude-sonnet-4","messages":[' + b'{"role":"user","content":"x"},' * 100_000 + b"broken"
    assert request_model("v1/messages", body) == "claude-sonnet-4"


def test_a_gemini_style_path_names_the_model() -> None:
    assert request_model("v1beta/models/gemini-2.5-pro:streamGenerateContent", b'{"contents":[]}') == \
        "gemini-2.5-pro"
    assert request_model("models/gemini-flash:generateContent", b"") == "gemini-flash"


def test_the_model_hint_reads_the_opening_or_the_end_of_a_body_but_never_parses_it() -> None:
    from proxy.providers.model_name import model_hint

    messages = ", ".join(['{"role": "user", "content": "' + "x" * 500 + '"}'] * 40)
    assert model_hint("responses", b'{"model": "gpt-5", "input": []}') == "gpt-5"
    assert model_hint("messages", b'{"max_tokens": 10, "model": "claude-x", "stream": true}') == "claude-x"
    assert model_hint("messages", f'{{"messages": [{messages}], "model": "last-\\u00e9"}}'.encode()) == "last-\u00e9"
    assert model_hint("messages", f'{{"messages": [{messages}], "model": "middle", "messages2": [{messages}]}}'
                      .encode()) is None
    assert model_hint("v1beta/models/gemini-2.5-pro:generateContent", b"{}") == "gemini-2.5-pro"
    assert model_hint("chat/completions", b"") is None
