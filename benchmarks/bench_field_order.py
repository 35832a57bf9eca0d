"""Putting undeclared fields in field order in a request of many small messages.

A keyed request holding any field the server's descriptors do not declare is put in field-number
order (``core/field_order.py``), so its fingerprint does not depend on where upb serialized the
undeclared fields. The client chooses both how many messages the request holds and which of them
hold an undeclared field. Two such requests of ``--mib`` MiB, against the floor of what a request
without undeclared fields costs (its deterministic serialization), in the same process:

- ``top``: empty ``lines`` entries, and one undeclared record in the request itself;
- ``every``: each entry has ``meta`` (3) set and an undeclared record 2 (a length-delimited
  record where ``seen_at`` is a varint), which upb serializes after ``meta``: every entry needs
  its records re-ordered.

``Req { repeated Line lines = 1; }``, ``Line { int64 amount = 1; int64 seen_at = 2; Meta meta =
3; }``, ``Meta { string trace = 1; }``, nothing excluded. With ``--base COMMIT`` the same is
measured for that commit's ``src/`` in a child process, rounds alternating, and both are printed.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_field_order.py
    PYTHONPATH=. .venv/bin/python benchmarks/bench_field_order.py --base HEAD --mib 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import _common

HERE = Path(__file__).resolve().parent

PAYLOADS = {
    # (one entry's record, the bytes after the entries)
    "top": (b"\x0a\x00", b"\x78\x01"),
    "every": (b"\x0a\x04\x1a\x00\x12\x00", b""),
}


def requests(mib: float) -> dict[str, Any]:
    req_type = _common.lines_request_type("benchfieldorder", exclude_seen_at=False)
    size = int(mib * (1 << 20))
    return {
        name: req_type.FromString(entry * ((size - len(tail)) // len(entry)) + tail)
        for name, (entry, tail) in PAYLOADS.items()
    }


def child(mib: float, repeat: int) -> None:
    """Measures on "go" lines from stdin, one JSON line each (this process's ``src/``)."""
    from grpc_idempotency.core.fingerprint import Fingerprinter

    built = requests(mib)
    fingerprint = Fingerprinter.for_method(
        "/benchfieldorder.Svc/Do", next(iter(built.values())).DESCRIPTOR
    )
    for _ in sys.stdin:
        row: dict[str, float] = {}
        for name, request in built.items():
            row[name] = _common.best_of(lambda r=request: fingerprint(r), repeat)
            row[f"{name}_floor"] = _common.best_of(
                lambda r=request: r.SerializePartialToString(deterministic=True), repeat
            )
        print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=1.0, help="size of each request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=2, help="best of this many per round")
    parser.add_argument("--base", help="also measure this commit's src/, side by side")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.mib, args.repeat)
        return

    results = _common.source_rounds(
        __file__,
        ["--mib", str(args.mib), "--repeat", str(args.repeat)],
        args.base,
        args.rounds,
        "bench-field-order-",
    )
    counts = {name: len(r.lines) for name, r in requests(args.mib).items()}
    print(f"{args.mib} MiB requests, best of {args.repeat}, median of {args.rounds} rounds")
    for label, rows in results.items():
        for name, entries in counts.items():
            spent = statistics.median(r[name] for r in rows)
            floor = statistics.median(r[f"{name}_floor"] for r in rows)
            print(
                f"{label:>16} {name:>5} ({entries} entries): fingerprint {spent * 1e3:8.1f} ms,"
                f" serialization {floor * 1e3:6.1f} ms, {spent / entries * 1e6:5.2f} us an entry"
            )


if __name__ == "__main__":
    main()
