"""The library's loggers, whose records' tracebacks show exception text escaped.

A record logged with ``exc_info`` had its message escaped (``core.log_text.loggable``), but its
traceback ended with the exception's own text, raw: an ``AioRpcError`` quotes the downstream's
details, PostgreSQL's errors quote the values they refused, so a newline there forged log lines
after the escaped message and an ESC sequence rewrote a terminal's. The library's loggers
(``library_logger``) carry a filter (``EscapedTracebacks``) that writes such a traceback with
each exception's text escaped, the frames keeping their lines. Not in ``core``: formatting a
traceback reads source lines from disk (linecache).
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any

from grpc_idempotency.core.log_text import loggable

__all__ = ["EscapedTracebacks", "escaped_traceback", "library_logger"]


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
