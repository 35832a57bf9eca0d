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


def test_the_commands_output_escapes_as_the_log_does() -> None:
    """``inspect``, ``list`` and ``outbox dead`` show stored text (a recorded error's message, a
    delivery's last error) through ``printable``: a bidi override or a line separator in it
    reordered or split what the operator read, as in a log line."""
    from grpc_idempotency.cli_errors import printable

    text = "refund \u202e0001$\u202c ok\u2028INFO forged\x1b[2K"
    assert printable(text) == loggable(text)
    assert "\u202e" not in printable(text) and "\u2028" not in printable(text)
