"""Migrations, once written, are frozen: a database records only the versions it applied
(``schema_migrations``), so a migration edited or renumbered after some database applied it is
silently skipped there, and that database keeps the old text for good. A change to the schema is
a new migration. This pins each file's name and a digest of its text."""

from __future__ import annotations

import hashlib

from grpc_idempotency.store.migrations import available_migrations

FROZEN = [
    (1, "records", "2c4a79b848de4662"),
    (2, "phased", "3b90bb48c320cda6"),
    (3, "hot_completion", "eb0ce3473ec8ad83"),
    (4, "final_takes_claim_lock", "4c96bbc4f7af5a07"),
    (5, "operation_start", "82262959160b6beb"),
    (6, "outbox", "fb811ef2993debd1"),
    (7, "retention_floor", "10fb5f9c936d75d2"),
    (8, "atomic_write_once", "fa95b75b2e80375f"),
    (9, "cheaper_completion", "aab754d79bc83b3b"),
    (10, "outbox_lost_claims", "4e4080e44c1b93bf"),
    (11, "outbox_failures_so_far", "29a6d1b6a757f27f"),
    (12, "claim_returns_start", "c8e38a330600fa0a"),
    (13, "fence_on_operation_start", "9be76c01597c1574"),
    (14, "abandoned_claim_past_retention", "cc06faebb6347210"),
    (15, "functions_fix_search_path", "3988792f25cb5193"),
    (16, "claim_knows_its_attempt", "5774c03d8e34811a"),
    (17, "processed_messages_fingerprint", "86200b6b970ce760"),
    (18, "outbox_trace_context", "a279bc0417201138"),
]


def test_no_migration_is_edited_renumbered_or_removed() -> None:
    found = [
        (m.version, m.name, hashlib.sha256(m.sql.encode()).hexdigest()[:16])
        for m in available_migrations()
    ]
    changed = [(want, got) for want, got in zip(FROZEN, found, strict=False) if want != got]
    assert not changed, (
        "a migration a database may have applied was edited or renumbered (it would be skipped"
        f" there for good): add a new migration instead. (frozen, found): {changed}"
    )
    assert len(found) >= len(FROZEN), "a migration was removed"
    # A new migration appends (its number after every frozen one); add it here once written.
    assert [v for v, _, _ in found] == list(range(1, len(found) + 1))
