"""``loggable``: text from other parties is one line in a log record, its controls escaped."""

from __future__ import annotations

import pytest

from grpc_idempotency.core.log_text import loggable


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("busy\nINFO forged", "busy\\nINFO forged"),
        ("a\r\nb", "a\\r\\nb"),
        ("\x1b[1A\x1b[2K", "\\x1b[1A\\x1b[2K"),
        ("nul\x00 del\x7f c1\x85\x9b", "nul\\x00 del\\x7f c1\\x85\\x9b"),
        ("line\u2028para\u2029", "line\\u2028para\\u2029"),
        ("\u202egnp.exe \u2066x\u2069", "\\u202egnp.exe \\u2066x\\u2069"),
        # What a reader can read as it is stays so: tabs are controls, accents and quotes not.
        ("z\u00fcrich 'q' \\n", "z\u00fcrich 'q' \\n"),
        ("tab\there", "tab\\there"),
    ],
)
def test_controls_separators_and_bidi_overrides_are_escaped(text: str, shown: str) -> None:
    assert loggable(text) == shown
    assert len(loggable(text).splitlines()) <= 1
