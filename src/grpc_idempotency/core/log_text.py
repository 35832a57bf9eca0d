"""Text the library does not control, made safe to put in a log record's message.

The library logs what other parties chose: a downstream service's status message (the relay's
failed deliveries, a downstream error that escaped a handler), a sink's exception text, a
method path a client sent. Whatever handler and formatter the application configured (plain
text, JSON) gets the record's message as it is: a newline in such text added a forged line to a
plain-text log, an ESC sequence rewrote a terminal's lines, a bidi override reordered what the
reader saw. Passed through ``loggable`` (as an argument, so formatting stays lazy), the text is
one line, its controls shown as escapes (``\\n``, ``\\x1b``, ``\\u202e``)."""

from __future__ import annotations

import re

# C0 controls, DEL and C1 controls (``keys.CONTROL_CHARACTERS``, which a scope may not hold);
# the Unicode line and paragraph separators, which split lines (str.splitlines, many viewers);
# the bidi embeddings, overrides and isolates, which reorder the text around them on display.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def loggable(text: str) -> str:
    """``text`` with each character that could split or disguise a log line as its escape
    (``repr``'s: ``\\n``, ``\\x1b``, ``\\u202e``); anything else, non-ASCII letters included,
    as it is. A backslash stays as it is: the result is for a reader, not to be parsed back."""
    return _UNSAFE.sub(_escape, text)


def _escape(match: re.Match[str]) -> str:
    return repr(match.group())[1:-1]
