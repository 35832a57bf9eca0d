"""``list``'s page cursor: where a listing cut at ``--limit`` goes on (``list --after``).

The listing's order, ``created_at DESC, key``, is total within a scope (a key is unique in it),
so the last record a page listed, (created_at, key), is one exact place in that order: records
inserted or purged meanwhile fall on one side of it or the other and move nothing, so across
pages no record is listed twice and none that was there is skipped (an OFFSET would shift by
every row inserted ahead of it). The cursor holds that pair exactly: the time as whole
microseconds since the Unix epoch (PostgreSQL's resolution; no time zone or rounding to carry),
the key as stored. It is opaque to operators, base64url of a small JSON object without padding
(no character a shell, a URL or a CSV treats specially, whatever quotes or commas the key
holds), and checked when read back: anything else is bad usage (exit 2), never sent to the
database to fail there as an error to retry.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)
_VERSION = 1
_BASE64URL = re.compile(r"[A-Za-z0-9_-]+")


class CursorInvalid(ValueError):
    """Text that is no cursor ``list`` printed."""


@dataclass(frozen=True, slots=True)
class ListCursor:
    """The last record a page listed: the next page lists the records after it."""

    created_at: datetime
    key: str

    def encode(self) -> str:
        micros = (self.created_at - _EPOCH) // _MICROSECOND
        doc = json.dumps({"v": _VERSION, "t": micros, "k": self.key}, separators=(",", ":"))
        return base64.urlsafe_b64encode(doc.encode("ascii")).rstrip(b"=").decode("ascii")


def decode_cursor(text: str) -> ListCursor:
    """The cursor ``text`` encodes; ``CursorInvalid`` if it is none ``encode`` made."""
    if not _BASE64URL.fullmatch(text):
        raise CursorInvalid("not a cursor: list prints one as letters, digits, - and _")
    try:
        doc = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
    # A bad length, bytes that are not UTF-8 or JSON, or JSON nested past the parser's depth.
    except (binascii.Error, ValueError, RecursionError):
        raise CursorInvalid("not a cursor list printed (cut short or mistyped?)") from None
    if (
        not isinstance(doc, dict)
        or set(doc) != {"v", "t", "k"}
        or type(doc["v"]) is not int
        or type(doc["t"]) is not int
        or not isinstance(doc["k"], str)
    ):
        raise CursorInvalid("not a cursor list printed (cut short or mistyped?)")
    if doc["v"] != _VERSION:
        raise CursorInvalid(f"a cursor of another release (version {doc['v']}): list again")
    key = doc["k"]
    # What no stored key holds: PostgreSQL's text refuses NUL, and a lone surrogate cannot
    # reach it as UTF-8; sent, either failed as a database error (exit 1, "retry later").
    if not key or "\x00" in key or _not_utf8(key):
        raise CursorInvalid("not a cursor list printed: its key is no stored key")
    try:
        created_at = _EPOCH + doc["t"] * _MICROSECOND
    except OverflowError:
        raise CursorInvalid("not a cursor list printed: its time is out of range") from None
    return ListCursor(created_at=created_at, key=key)


def _not_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
