"""``grpc-idempotency inspect`` and ``list``: one operation as a tree, and a scope's records.

``cli.py`` wires these commands in. This package parses their options (``parsers``) and
configuration file (``config``), loads the descriptors that decode stored messages
(``descriptors``), drives the look-ups (``lookup``, over ``store/inspection_store.py``), and
renders what ``core/inspection.py`` decides, as a tree (``text_output``) or as JSON
(``json_output``); ``commands`` runs the two commands; ``cursor`` is ``list``'s page cursor
(``--after``).

Exit status of ``inspect``: 0 the operation was found; 3 no configured store holds it; 4 found,
but a step's child key reached more than one record or outbox row (never expected: a store
configured twice under two names, or records copied between stores), or one method's operation
under the key has a record in more than one store (DUPLICATED: a retry that reached another
shard ran it again); 1 a store could not be
reached (retry later); 2 a store answers but cannot be used (no such database or role, bad
password, schema not migrated before 0007), bad usage, or an unusable configuration, module or
descriptor set. ``list``: 0 records listed, 3 none matched, 1 and 2 as above. A schema migrated
that far but behind this release is read as it stands (a rolling upgrade installs the command
before migrating), with a warning naming the migrations missing and ``migrate`` (``inspect``
follows it, and one about a newer release's migrations, with the store's line, as a refusal);
see ``store/inspection_store.py``.
"""

from __future__ import annotations

from grpc_idempotency.inspect_cli.commands import (
    DUPLICATED,
    FOUND,
    NOT_FOUND,
    UNREACHABLE,
    UNUSABLE,
    list_cursor_mismatch,
    run_inspect,
    run_list,
)
from grpc_idempotency.inspect_cli.config import Config, ConfigError, StoreConfig, config_of
from grpc_idempotency.inspect_cli.descriptors import Descriptors
from grpc_idempotency.inspect_cli.json_output import inspect_json, record_json
from grpc_idempotency.inspect_cli.parsers import add_parsers
from grpc_idempotency.inspect_cli.text_output import render_tree

__all__ = [
    "add_parsers",
    "run_inspect",
    "run_list",
    "list_cursor_mismatch",
    "FOUND",
    "UNREACHABLE",
    "UNUSABLE",
    "NOT_FOUND",
    "DUPLICATED",
    "ConfigError",
    "StoreConfig",
    "Config",
    "config_of",
    "Descriptors",
    "record_json",
    "inspect_json",
    "render_tree",
]
