"""Text the library does not control, made safe to put in a log record's message; and the one
rule of which characters make text unsafe to show, which scopes may not hold.

The library logs what other parties chose: a downstream service's status message (the relay's
failed deliveries, a downstream error that escaped a handler), a sink's exception text, a
method path a client sent. Whatever handler and formatter the application configured (plain
text, JSON) gets the record's message as it is: a newline in such text added a forged line to a
plain-text log, an ESC sequence rewrote a terminal's lines, a bidi override reordered what the
reader saw. Passed through ``loggable`` (as an argument, so formatting stays lazy), the text is
one line, its controls shown as escapes (``\\n``, ``\\x1b``, ``\\u202e``).

A record logged with ``exc_info`` carries such text in its traceback too: the library's
loggers escape it there with the same rule (``grpc_idempotency.log_tracebacks``, outside
``core`` as formatting a traceback reads source files).

A scope is shown as it is (log lines, ``inspect``, ``outbox dead``) and names a tenant, so it
may hold none of them (``keys.validate_scope``, through ``unsafe_character``): escaped, two
scopes would still read the same where one holds an invisible character.
"""

from __future__ import annotations

import unicodedata

_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp"})
# ZERO WIDTH NON-JOINER and JOINER: format characters that spell words in Persian, the Indic
# scripts and emoji sequences, and that move nothing on display (IDNA and PRECIS, RFC 5892 and
# RFC 8264, allow these two of the format characters, in context, and refuse the rest).
_JOINERS = frozenset("\u200c\u200d")


def is_unsafe(char: str) -> bool:
    """Whether ``char`` could split or disguise a line of text where it is shown: a control
    (C0, DEL, C1: a newline, ESC), a line or paragraph separator (which split lines for
    str.splitlines and many viewers), or a format character other than ZWNJ and ZWJ: the bidi
    embeddings, overrides, isolates and marks, which reorder the text around them on display,
    and the invisible ones (zero width space, soft hyphen, BOM, word joiner, tags), with which
    two different texts read the same. By Unicode category (Cc, Zl, Zp, Cf), as this Python's
    ``unicodedata`` knows them; lone surrogates, private-use and unassigned code points are not
    among them (a scope cannot be encoded with a lone surrogate, and is refused for that)."""
    return unicodedata.category(char) in _UNSAFE_CATEGORIES and char not in _JOINERS


def unsafe_character(text: str) -> str | None:
    """The first character of ``text`` that ``is_unsafe``; ``None`` when it holds none."""
    if text.isprintable():  # in C, and false for every unsafe character: the common case
        return None
    return next((char for char in text if is_unsafe(char)), None)


def loggable(text: str) -> str:
    """``text`` with each character that could split or disguise a log line (``is_unsafe``)
    as its escape (``repr``'s: ``\\n``, ``\\x1b``, ``\\u202e``); anything else, non-ASCII
    letters included, as it is. A backslash stays as it is: the result is for a reader, not to
    be parsed back."""
    if text.isprintable():
        return text
    return "".join(repr(char)[1:-1] if is_unsafe(char) else char for char in text)


def code_point(char: str) -> str:
    """``char`` named as ``U+202E``: for an error saying which character it refuses without
    showing it (or the text around it)."""
    return f"U+{ord(char):04X}"
