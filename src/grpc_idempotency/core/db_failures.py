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

``outage`` decides a narrower question: whether the database is unreachable or gave up on the
session, which alone lets a fail-open method run without deduplication. A timeout, a cancel
or a lock timeout is UNAVAILABLE or CONFLICT for the client (retry), but the database that
raised it is up and may hold the key's outcome: running the handler unclaimed then re-ran
completed keys (a role's statement_timeout or lock_timeout meeting a table locked by a
migration or VACUUM FULL).
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


_OUTAGE_CODES = frozenset(
    {
        "57P01",  # admin_shutdown: failover, restart
        "57P02",  # crash_shutdown
        "57P03",  # cannot_connect_now: starting up, or shutting down
        "53300",  # too_many_connections
        "25006",  # read_only_sql_transaction: connected to a replica after a failover
    }
)


# protocol_violation: what PgBouncer answers for every failure of its own, whatever the
# database's state: a server login that failed (down), but also a client that waited past
# query_wait_timeout for a server connection (a busy pool, the database up), or one past
# max_client_conn. PostgreSQL itself sends it only to a client that broke the protocol.
# connection_does_not_exist: the connection was closed in the middle of an operation, by the
# server or by a pooler in front of it. asyncpg 0.32 chains PgBouncer's 08P01 to it as its
# cause; asyncpg 0.30 raises it bare, so a pooler's error looks like any connection closed.
_PRESUMED_CODES = frozenset({"08P01", "08003"})


def presumed_outage(sqlstate: str | None) -> bool:
    """Whether an ``outage`` with ``sqlstate`` is only presumed, to be confirmed on a connection
    of its own before a fail-open method runs unclaimed: a pooler's error (08P01), or a
    connection closed in the middle of an operation (08003), neither of which says whether the
    database is up. (A timeout measured on the client side, with no SQLSTATE, is presumed too:
    the store marks that one itself.) A database shutting down says so first (57P01, a
    certain outage)."""
    return sqlstate in _PRESUMED_CODES


def outage(sqlstate: str | None) -> bool:
    """Whether a failure with ``sqlstate`` says the database is unreachable or unusable for
    writes (a fail-open method may run without it): no SQLSTATE (a socket error, a closed
    connection, a statement the database stopped answering), class 08 (connection exception),
    a shutdown or start-up, too many connections, a read-only server. Not a timeout, a cancel
    or a lock timeout (57014, 55P03): the database answered, and holds the records.

    A statement the database stopped answering is only presumed an outage: a table lock blocks
    statements in a live database just the same. The store marks such a failure ambiguous
    (``StoreUnavailable.ambiguous``), and the server confirms it (``Store.answers``)."""
    if not sqlstate:
        return True
    return sqlstate[:2] == "08" or sqlstate in _OUTAGE_CODES
