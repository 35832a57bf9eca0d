"""Settings given as a number of seconds: one check, one cap, one wording for all of them.

Why one check
-------------
Each such setting is compared, slept on, added to the database's clock or made a gRPC deadline.
Checked by hand at each site, they disagreed: some took NaN (it compares false both ways, so a
wait never ended or never began), some took 10**400 (an int below ``math.inf`` that raised a
bare ``OverflowError`` once slept on), some raised ``ValueError`` for text, and each said so in
its own words. Pure: no I/O."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Literal, overload

MAX_DURATION = timedelta(days=36500)
"""The longest retention, lease or wait: added to the database's clock, a longer one can
overflow a timestamp (SQLSTATE 22008), which failed every call as if the store were down."""
MAX_DURATION_S = MAX_DURATION.total_seconds()
"""``MAX_DURATION`` in seconds, the cap of every setting given as a number of seconds: past
about 7e9 s from now gRPC's deadline overflows too, and 10**400 cannot be slept on."""
MAX_DURATION_MS = int(MAX_DURATION_S) * 1000
"""``MAX_DURATION`` in whole milliseconds, as a pushback comes over the wire: compared with one
as an int (exact), never dividing it (one of 309 digits or more overflows a float)."""


@overload
def checked_seconds(
    name: str,
    value: object,
    *,
    positive: bool = ...,
    or_none: Literal[False] = ...,
    minimum: float = ...,
    cap: float = ...,
) -> float: ...
@overload
def checked_seconds(
    name: str,
    value: object,
    *,
    positive: bool = ...,
    or_none: Literal[True],
    minimum: float = ...,
    cap: float = ...,
) -> float | None: ...
def checked_seconds(
    name: str,
    value: object,
    *,
    positive: bool = False,
    or_none: bool = False,
    minimum: float = 0.0,
    cap: float = MAX_DURATION_S,
) -> float | None:
    """``value`` as given, once it is a number of seconds from ``minimum`` (above it if
    ``positive``) up to ``cap``; ``None`` too if ``or_none``. ``minimum=-math.inf`` or
    ``cap=math.inf`` leaves that side open (NaN is refused all the same).

    Raises ``TypeError`` for anything but an int or float (a bool too: True was taken for 1 s),
    and ``ValueError`` for a number out of range, NaN included; each names the setting, and the
    ``ValueError`` the range, both with the value."""
    if value is None and or_none:
        return None
    none = "None or " if or_none else ""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be {none}a number of seconds, not {value!r}")
    # Compared as given, not through float() or math.isfinite: an int too large for a float
    # raises OverflowError from both. Written so that NaN fails (it compares false both ways).
    if not ((minimum < value) if positive else (minimum <= value)) or not value <= cap:
        raise ValueError(
            f"{name} must be {none}a number of seconds{_span(positive, minimum, cap)},"
            f" not {value!r}"
        )
    return value


def _span(positive: bool, minimum: float, cap: float) -> str:
    if positive:
        low = f" above {minimum:g}"
    elif minimum == -math.inf:
        low = ""
    else:
        low = f" from {minimum:g}"
    high = "" if cap == math.inf else f" up to {cap:g} ({cap / 86400:g} days)"
    return low + high
