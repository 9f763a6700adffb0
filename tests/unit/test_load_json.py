"""The runtime connections' JSON decoder reads every value as json.loads does."""

from __future__ import annotations

import json

import pytest

from appliance.db.database import load_json


@pytest.mark.parametrize(
    "text",
    [
        b'{"i": 1, "nested": {"a": [1, 2.5, null, true, "x"]}}',
        b"123456789012345678901234567890",
        b"-0.1",
        b"1E+2",
        b'"\\u0000\\u00e9\\ud83d\\ude00"',
        b'{"a": 1, "a": 2}',
        b"1e400",  # jsonb keeps any numeric; json.loads reads infinity, and so must this
        b"-1e400",
    ],
)
def test_reads_as_the_standard_library_does(text: bytes) -> None:
    assert load_json(text) == json.loads(text)


def test_malformed_json_is_an_error() -> None:
    with pytest.raises(json.JSONDecodeError):
        load_json(b'{"a": ')
