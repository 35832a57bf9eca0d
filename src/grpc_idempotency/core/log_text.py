"""Text the library does not control, made safe to put in a log record's message.

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
their lines (``EscapedTracebacks``)."""

from __future__ import annotations

import logging
import re
import traceback
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

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


def escaped_traceback(
    exc_info: tuple[type[BaseException], BaseException, TracebackType | None],
) -> str | None:
    """The traceback of ``exc_info`` as ``logging.Formatter.formatException`` writes it, each
    exception's own text (its message, its notes; its causes', contexts' and group members'
    too) through ``loggable``; ``None`` when none of that text needed escaping. The frames keep
    their lines. The exceptions are left as they are: their callers may still hold them."""
    top = traceback.TracebackException(*exc_info, compact=True)
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
        # list (the exception's own is the one TracebackException holds).
        notes = node.__notes__
        if isinstance(notes, list | tuple):
            safe = [loggable(n) if isinstance(n, str) else n for n in notes]
            changed.extend(n for n, s in zip(notes, safe, strict=True) if n != s)
            node.__notes__ = safe
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
        if info and info[0] is not None and info[1] is not None and not record.exc_text:
            try:
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
