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

A position is one only in the listing it was taken from: another scope's, or the same scope's
under another ``--state`` or ``--method``, is another order of other records, where the pair
silently started a page from an arbitrary place. So the cursor carries digests of its listing
(``Listing``): of the scope, and of the scope with every filter that changes which records are
listed; a cursor given to another listing is refused (exit 2), saying whether the scope or the
filters differ. Digests, not the values: a cursor stays short whatever the scope holds, and says
nothing of the scope's name to whoever sees it. ``--limit`` is not part of the identity: it cuts
pages, and changing it between pages moves no record.

A key claimed again once its record expired is a new operation, begun when it was claimed: it
lists among the newest, not where its old record was. A listing paged on meanwhile does not show
it (it is ahead of the cursor, as any operation begun since), and its old record is gone, as a
purged one would be. That is the order's meaning, not a gap: paging by operation start, a new
operation cannot sit where an older one was.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)
# 2: with the listing's digests. Nothing printed 1 was released; it is refused as another
# release's all the same, not read as no cursor.
_VERSION = 2
_FIELDS = frozenset({"v", "t", "k", "s", "l"})
_DIGEST = re.compile(r"[0-9a-f]{8}")
_BASE64URL = re.compile(r"[A-Za-z0-9_-]+")


class CursorInvalid(ValueError):
    """Text that is no cursor ``list`` printed."""


@dataclass(frozen=True, slots=True)
class Listing:
    """What ``list`` lists: a scope's records, filtered. ``method`` as ``normalize_method``
    gives it (the spellings --method takes of one method are one listing); ``state``, the
    --state given."""

    scope: str
    state: str | None = None
    method: str | None = None

    def scope_digest(self) -> str:
        return _digest([self.scope])

    def digest(self) -> str:
        return _digest([self.scope, self.state, self.method])


def _digest(parts: list[str | None]) -> str:
    # 32 bits: a check against a cursor given to the wrong listing by mistake, not against a
    # forged one (a forged cursor can only page a listing its maker could list anyway).
    text = json.dumps(parts, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]


@dataclass(frozen=True, slots=True)
class ListCursor:
    """The last record a page of ``listing`` listed: the next page lists the records after it.
    ``scope_digest`` and ``listing_digest``: ``Listing``'s, of the listing it was taken from."""

    created_at: datetime
    key: str
    scope_digest: str
    listing_digest: str

    @classmethod
    def of(cls, listing: Listing, created_at: datetime, key: str) -> ListCursor:
        return cls(created_at, key, listing.scope_digest(), listing.digest())

    def encode(self) -> str:
        micros = (self.created_at - _EPOCH) // _MICROSECOND
        doc = json.dumps(
            {
                "v": _VERSION,
                "t": micros,
                "k": self.key,
                "s": self.scope_digest,
                "l": self.listing_digest,
            },
            separators=(",", ":"),
        )
        return base64.urlsafe_b64encode(doc.encode("ascii")).rstrip(b"=").decode("ascii")

    def mismatch(self, listing: Listing) -> str | None:
        """Why this cursor cannot page ``listing``: None if it is that listing's."""
        if self.scope_digest != listing.scope_digest():
            return (
                "a cursor of another scope's listing: page with the --scope that printed it,"
                " or list this scope without --after"
            )
        if self.listing_digest != listing.digest():
            return (
                "a cursor of this scope listed with other filters: page with the --state and"
                " --method that printed it, or list without --after"
            )
        return None


def decode_cursor(text: str) -> ListCursor:
    """The cursor ``text`` encodes; ``CursorInvalid`` if it is none ``encode`` made."""
    if not _BASE64URL.fullmatch(text):
        raise CursorInvalid("not a cursor: list prints one as letters, digits, - and _")
    try:
        doc = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
    # A bad length, bytes that are not UTF-8 or JSON, or JSON nested past the parser's depth.
    except (binascii.Error, ValueError, RecursionError):
        raise CursorInvalid("not a cursor list printed (cut short or mistyped?)") from None
    if isinstance(doc, dict) and type(doc.get("v")) is int and doc["v"] != _VERSION:
        # Before the fields are checked: another release's hold others.
        raise CursorInvalid(f"a cursor of another release (version {doc['v']}): list again")
    if (
        not isinstance(doc, dict)
        or set(doc) != _FIELDS
        or type(doc["v"]) is not int
        or type(doc["t"]) is not int
        or not isinstance(doc["k"], str)
        or not isinstance(doc["s"], str)
        or not isinstance(doc["l"], str)
        or not _DIGEST.fullmatch(doc["s"])
        or not _DIGEST.fullmatch(doc["l"])
    ):
        raise CursorInvalid("not a cursor list printed (cut short or mistyped?)")
    key = doc["k"]
    # What no stored key holds: PostgreSQL's text refuses NUL, and a lone surrogate cannot
    # reach it as UTF-8; sent, either failed as a database error (exit 1, "retry later").
    if not key or "\x00" in key or _not_utf8(key):
        raise CursorInvalid("not a cursor list printed: its key is no stored key")
    try:
        created_at = _EPOCH + doc["t"] * _MICROSECOND
    except OverflowError:
        raise CursorInvalid("not a cursor list printed: its time is out of range") from None
    return ListCursor(created_at, key, scope_digest=doc["s"], listing_digest=doc["l"])


def _not_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
