"""Text the library does not control, made safe to put in a log record's message; and the one
rule of which characters make text unsafe to show, which scopes may not hold.

The library logs what other parties chose: a downstream service's status message (the relay's
failed deliveries, a downstream error that escaped a handler), a sink's exception text, a
method path a client sent. Whatever handler and formatter the application configured (plain
text, JSON) gets the record's message as it is: a newline in such text added a forged line to a
plain-text log, an ESC sequence rewrote a terminal's lines, a bidi override reordered what the
reader saw. Passed through ``loggable`` (as an argument, so formatting stays lazy), the text is
one line, its controls shown as escapes (``\\n``, ``\\x1b``, ``\\u202e``).

A record logged with ``exc_info`` carries such text in its traceback too (an ``AioRpcError``
quotes the downstream's details, PostgreSQL's errors quote the values they refused): the
library's loggers (``library_logger``) escape each exception's text there, the frames keeping
their lines (``EscapedTracebacks``).

A scope is shown as it is (log lines, ``inspect``, ``outbox dead``) and names a tenant, so it
may hold none of them (``keys.validate_scope``, through ``unsafe_character``): escaped, two
scopes would still read the same where one holds an invisible character.
"""

from __future__ import annotations

import logging
import traceback
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any

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


def escaped_traceback(
    exc_info: tuple[type[BaseException], BaseException, TracebackType | None],
) -> str | None:
    """The traceback of ``exc_info`` as ``logging.Formatter.formatException`` writes it, each
    exception's own text (its message, its notes; its causes', contexts' and group members'
    too) through ``loggable``; ``None`` when none of that text needed escaping. The frames keep
    their lines. The exceptions are left as they are: their callers may still hold them."""
    # type(value), not exc_info[0]: what logging's print_exception shows for a mismatched tuple.
    value = exc_info[1]
    top = traceback.TracebackException(type(value), value, exc_info[2], compact=True)
    changed: list[str] = []  # the texts escaped

    def escaping(plain: Callable[..., Iterator[str]]) -> Callable[..., Iterator[str]]:
        def format_exception_only(*args: Any, **kwargs: Any) -> Iterator[str]:
            for chunk in plain(*args, **kwargs):
                text = chunk.removesuffix("\n")
                safe = loggable(text)
                if safe != text:
                    changed.append(text)
                yield safe + chunk[len(text) :]

        return format_exception_only

    seen: set[int] = set()
    todo = [top]
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        # On the instance: format() asks each exception of the chain for its text through it.
        vars(node)["format_exception_only"] = escaping(node.format_exception_only)
        # A note's lines come as chunks of their own: escaped before they are split, in a new
        # list (the exception's own is the one TracebackException holds). The traceback shows
        # str() of each note of any sequence but a str or bytes (a note object, a str subclass
        # with a __str__ of its own, a deque of notes); one whose str() fails is left to it.
        notes = node.__notes__
        if isinstance(notes, Sequence) and not isinstance(notes, str | bytes):
            safe: list[object] = []
            for note in notes:
                try:
                    text = str(note)
                except Exception:
                    safe.append(note)
                    continue
                safe.append(loggable(text))
                if safe[-1] != text:
                    changed.append(text)
            node.__notes__ = safe  # type: ignore[assignment]  # shown through str(), as notes are
        todo.extend(n for n in (node.__cause__, node.__context__) if n is not None)
        todo.extend(node.exceptions or ())
    text = "".join(top.format())
    return text.removesuffix("\n") if changed else None


class EscapedTracebacks(logging.Filter):
    """Escapes the exception text in the traceback of a record logged with ``exc_info``: an
    exception may quote what other parties chose (a downstream's status message, a value a
    client sent that PostgreSQL's error quotes), and a formatter writes it raw after the escaped
    message. Sets ``record.exc_text``, which ``logging.Formatter`` writes instead of formatting
    ``exc_info`` itself, only when something needed escaping; ``exc_info`` is left as it is
    (an error tracker reads the exception, not a log line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        info = record.exc_info
        if info and not record.exc_text:
            try:  # a malformed exc_info too: the formatter's to report, as without this filter
                if info[0] is None or info[1] is None:
                    return True
                text = escaped_traceback((info[0], info[1], info[2]))
            except Exception:  # never fail the library's log call: the record goes as it is
                return True
            if text is not None:
                record.exc_text = text
        return True


_ESCAPED_TRACEBACKS = EscapedTracebacks()


def library_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)``, its tracebacks' exception text escaped (``EscapedTracebacks``,
    which applies to the records logged on it, not to its children's)."""
    logger = logging.getLogger(name)
    if _ESCAPED_TRACEBACKS not in logger.filters:
        logger.addFilter(_ESCAPED_TRACEBACKS)
    return logger


def code_point(char: str) -> str:
    """``char`` named as ``U+202E``: for an error saying which character it refuses without
    showing it (or the text around it)."""
    return f"U+{ord(char):04X}"
