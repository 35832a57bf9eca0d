"""What a database failure means for a call, decided from its SQLSTATE alone (no driver here).

The store and the server map every database error through ``classify`` so that a client sees
one of four answers, never a driver's text:

    UNAVAILABLE    the database could not be reached or gave up on the session (connection
                   lost, shutdown, too many connections, a timeout): retry later
    CONFLICT       the transaction lost a race (serialization failure, deadlock, lock
                   timeout) and was rolled back: retry now, the key was released
    MISCONFIGURED  it answers, but permanently wrongly (schema not migrated, no such database,
                   no privilege, bad password): an operator must act; retrying cannot help
    OTHER          anything else (a constraint, bad SQL): a bug to be logged

A failure without a SQLSTATE (a socket error, a closed connection) is UNAVAILABLE.
"""

from __future__ import annotations

import enum


class Failure(enum.Enum):
    UNAVAILABLE = "unavailable"
    CONFLICT = "conflict"
    MISCONFIGURED = "misconfigured"
    OTHER = "other"


# Classes (first two characters) and codes, from PostgreSQL's Appendix A.
_UNAVAILABLE_CLASSES = frozenset({"08", "53", "57", "58", "XX"})
_UNAVAILABLE_CODES = frozenset(
    {
        "25P03",  # idle_in_transaction_session_timeout ended the session
        "25P04",  # transaction_timeout
        "25006",  # read_only_sql_transaction: connected to a replica after a failover
    }
)
_CONFLICT_CODES = frozenset(
    {
        "40001",  # serialization_failure
        "40P01",  # deadlock_detected
        "55P03",  # lock_not_available (lock_timeout)
    }
)
_MISCONFIGURED_CODES = frozenset(
    {
        "42P01",  # undefined_table: migrations not run, or the wrong schema
        "42703",  # undefined_column: migrations partly run
        "42883",  # undefined_function: the store's functions are missing
        "3F000",  # invalid_schema_name
        "3D000",  # invalid_catalog_name: no such database
        "42501",  # insufficient_privilege
        "28000",  # invalid_authorization_specification
        "28P01",  # invalid_password
    }
)


def classify(sqlstate: str | None) -> Failure:
    if not sqlstate:
        return Failure.UNAVAILABLE
    if sqlstate in _CONFLICT_CODES:
        return Failure.CONFLICT
    if sqlstate in _MISCONFIGURED_CODES:
        return Failure.MISCONFIGURED
    # 57014 query_canceled (statement_timeout, a cancel request) falls in class 57: transient.
    if sqlstate[:2] in _UNAVAILABLE_CLASSES or sqlstate in _UNAVAILABLE_CODES:
        return Failure.UNAVAILABLE
    return Failure.OTHER
