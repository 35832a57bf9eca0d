"""``loggable``: text from other parties is one line in a log record, its controls escaped."""

from __future__ import annotations

import collections
import io
import logging
from typing import Any

import pytest

from grpc_idempotency.core.log_text import loggable
from grpc_idempotency.log_tracebacks import EscapedTracebacks, escaped_traceback, library_logger


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
        # Invisible format characters and bidi marks: two texts that read the same otherwise.
        ("ac\u200bme\u200f\u00ad\ufeff\U000e0041", "ac\\u200bme\\u200f\\xad\\ufeff\\U000e0041"),
        # ZWNJ and ZWJ spell words (Persian, Indic scripts, emoji): kept, as a scope keeps them.
        (
            "\u0645\u06cc\u200c\u062e \U0001f469\u200d\U0001f4bb",
            "\u0645\u06cc\u200c\u062e \U0001f469\u200d\U0001f4bb",
        ),
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


# -- tracebacks ---------------------------------------------------------------------------------

FORGED = "2026-01-01 00:00:00,000 INFO grpc_idempotency.server: ok"
UNSAFE = "\n\r\x1b\u202e\u2028"


def logged(exc: BaseException, logger: str = "grpc_idempotency.test_log_text") -> str:
    """What an application's plain handler on the root logger writes for a library logger's
    record of ``exc``, traceback and all."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        library_logger(logger).error("a call failed", exc_info=exc)
    finally:
        root.removeHandler(handler)
    return out.getvalue()


def raised(exc: BaseException, cause: BaseException | None = None) -> BaseException:
    try:
        raise exc from cause
    except BaseException as err:
        return err


def test_a_traceback_shows_the_exceptions_text_escaped_and_keeps_its_frames() -> None:
    """The record's message was escaped, its traceback not: an exception quoting a downstream's
    status message or a client's value (PostgreSQL's errors quote it) forged lines after it."""
    cause = raised(KeyError(f"k\n{FORGED}"))
    err = raised(ValueError(f"busy\n{FORGED}\x1b[2K\u202e"), cause)
    err.add_note(f"note\n{FORGED}")
    text = logged(err)
    lines = text.splitlines()
    assert not any(line.startswith(FORGED) for line in lines), text
    assert not any(c in line for line in lines for c in UNSAFE), text
    assert f"ValueError: busy\\n{FORGED}\\x1b[2K\\u202e" in lines, text
    assert f"KeyError: 'k\\n{FORGED}'" in lines and f"note\\n{FORGED}" in lines, text
    assert "The above exception was the direct cause of the following exception:" in lines
    assert sum(line.startswith("Traceback (most recent call last):") for line in lines) == 2
    assert sum(line.startswith('  File "') for line in lines) == 2  # the frames, one each
    # The exceptions are the caller's: left as they were.
    assert str(err) == f"busy\n{FORGED}\x1b[2K\u202e" and err.__notes__ == [f"note\n{FORGED}"]


def test_a_group_members_text_is_escaped_too() -> None:
    member = raised(RuntimeError(f"a\n{FORGED}"))
    assert isinstance(member, RuntimeError)
    group = raised(ExceptionGroup("two\nfailed", [member]))
    text = logged(group)
    assert not any(line.startswith(FORGED) for line in text.splitlines()), text
    assert "two\\nfailed" in text and f"RuntimeError: a\\n{FORGED}" in text, text


def test_a_traceback_with_nothing_to_escape_is_left_to_the_applications_formatter() -> None:
    """``exc_text`` set, ``logging.Formatter`` writes it instead of calling ``formatException``
    (which an application's formatter may override): set only when something needed escaping."""
    clean = raised(RuntimeError("plain text, tab-free"))
    assert escaped_traceback((RuntimeError, clean, clean.__traceback__)) is None
    record = logging.LogRecord(
        "x", logging.ERROR, __file__, 1, "m", (), (RuntimeError, clean, None)
    )
    assert EscapedTracebacks().filter(record) and record.exc_text is None
    formatter = logging.Formatter()
    expected = formatter.formatException((RuntimeError, clean, clean.__traceback__))
    assert logged(clean).endswith(expected + "\n")


def test_a_scope_may_hold_exactly_what_a_log_line_shows_as_it_is() -> None:
    """One rule (``log_text.is_unsafe``): what ``loggable`` escapes, no scope may hold, and a
    scope reads the same in a log line, ``inspect`` and ``outbox dead``. Over the BMP and the
    tags block (the astral format characters' home), a few hundred milliseconds."""
    from grpc_idempotency.core.errors import ScopeUnavailable
    from grpc_idempotency.core.keys import validate_scope

    for cp in [*range(0xD800), *range(0xE000, 0x10000), *range(0xE0000, 0xE0080)]:
        char = chr(cp)
        escaped = loggable(char) != char
        try:
            validate_scope("t" + char)
            refused = False
        except ScopeUnavailable:
            refused = True
        assert escaped == refused, f"U+{cp:04X}"


class Shown:
    """A note that is not a str: the traceback shows its ``str()``."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text


def test_notes_that_are_not_a_list_of_str_are_escaped_too() -> None:
    """The traceback shows ``str()`` of each note of any sequence, split at its newlines before
    the exception's text is escaped: only a list or tuple's str notes were escaped, so a note
    object, a str subclass with a ``__str__`` of its own, or a deque of notes forged lines."""

    class Quiet(str):
        def __str__(self) -> str:
            return f"loud\n{FORGED}"

    for notes in (
        [Shown(f"obj\n{FORGED}")],
        [Quiet("quiet")],
        collections.deque([f"dq\n{FORGED}"]),
    ):
        err = raised(ValueError("v"))
        err.__notes__ = notes  # type: ignore[assignment]  # what a library may set
        text = logged(err)
        assert not any(line.startswith(FORGED) for line in text.splitlines()), text
        assert f"\\n{FORGED}" in text, text
        assert err.__notes__ is notes  # the caller's, left as it was
    # A note whose str() fails is shown as the standard formatter shows it.
    err = raised(ValueError("v"))
    err.__notes__ = [Unprintable(), f"n\n{FORGED}"]  # type: ignore[list-item]
    text = logged(err)
    assert "<note str() failed>" in text and f"n\\n{FORGED}" in text, text


class Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no text")


def test_a_traceback_shows_the_exceptions_own_type_as_the_standard_formatter_does() -> None:
    """``logging.Formatter`` shows ``type(exc_info[1])``, whatever ``exc_info[0]`` says."""
    err = raised(OSError(f"o\n{FORGED}"))
    info = (ValueError, err, err.__traceback__)
    text = escaped_traceback(info)
    assert text is not None and f"\nOSError: o\\n{FORGED}" in text, text
    plain = logging.Formatter().formatException(info)
    assert text == plain.replace(f"\n{FORGED}", f"\\n{FORGED}"), (text, plain)


def test_the_filter_never_fails_a_log_call() -> None:
    """A malformed ``exc_info`` is the formatter's to report (``Handler.handleError``), as
    without the filter: raised from the filter, it failed the library's log call itself."""
    malformed: Any = (ValueError,)  # a log call's own tuple, passed on as it is
    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "m", (), malformed)
    assert EscapedTracebacks().filter(record) and record.exc_text is None


class Odd:
    """``__notes__`` that is no sequence: the traceback shows its ``repr()``."""

    def __repr__(self) -> str:
        return f"odd\n{FORGED}"


def test_notes_that_are_no_sequence_are_escaped() -> None:
    """Python 3.11 to 3.13 yield such ``__notes__``'s repr() as one piece, escaped as it is;
    CPython's main branch (gh-140051, colored notes, after 3.14) splits it at its newlines
    first, as it does a note's: this fails there until ``escaped_traceback`` escapes the repr
    itself."""
    err = raised(ValueError("v"))
    err.__notes__ = Odd()  # type: ignore[assignment]  # what a library may set
    text = logged(err)
    assert not any(line.startswith(FORGED) for line in text.splitlines()), text
    assert f"odd\\n{FORGED}" in text, text
