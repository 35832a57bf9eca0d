"""The test kit's counters (``count_effects``, ``count_external_effects``) may return any whole
number: PostgreSQL's ``sum()`` of a bigint column is numeric, which asyncpg returns as a
``Decimal``; the kit took it (``int()``) before it checked what a counter returns."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from grpc_idempotency.testing.conformance import _counted


async def _returning(value: Any) -> Any:
    return value


@pytest.mark.parametrize("value", [3, Decimal(3), Decimal("3.000")])
async def test_a_whole_number_of_any_type_is_a_count(value: Any) -> None:
    count = await _counted(_returning(value), "count_effects(db, request)")
    assert count == 3 and type(count) is int


@pytest.mark.parametrize("value", [None, [1], True, Decimal("2.5"), Decimal("NaN"), 2.0, "3"])
async def test_anything_else_is_named(value: Any) -> None:
    with pytest.raises(TypeError, match=r"^count_effects\(db, request\) must be an async"):
        await _counted(_returning(value), "count_effects(db, request)")
