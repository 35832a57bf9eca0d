"""Clearing FINGERPRINT_EXCLUDE fields in a request of many small messages.

The client chooses how many messages a keyed request holds: 4 MiB of empty repeated entries is
two million. Fingerprinting it clears each one's excluded fields in Python, with the GIL held,
so a thread does not help the server's other calls. Measured against the least work clearing
needs (copy the request, then one ``ClearField`` per message), in the same process, so the
machine's speed cancels out: the ratio is what the library adds over that floor.

``Req { repeated Line lines = 1; }``, ``Line { int64 amount = 1; int64 seen_at = 2
[FINGERPRINT_EXCLUDE]; Meta meta = 3; }``, ``Meta { string trace = 1; }``: --messages empty
lines, two of them with something set. With ``--base COMMIT`` the same is measured for that
commit's ``src/`` in a child process, rounds alternating, and both are printed.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_fingerprint_clearing.py
    PYTHONPATH=. .venv/bin/python benchmarks/bench_fingerprint_clearing.py --base c0d0b43^
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import _common

HERE = Path(__file__).resolve().parent


def child(messages: int, repeat: int) -> None:
    """Measures on "go" lines from stdin, one JSON line each (this process's ``src/``)."""
    from grpc_idempotency.core.fingerprint import Fingerprinter

    req_type = _common.lines_request_type("benchclearing", exclude_seen_at=True)
    request = req_type.FromString(b"\x0a\x00" * messages)
    request.lines[7].seen_at = 1
    request.lines[9].meta.trace = "t"
    fingerprint = Fingerprinter.for_method("/benchclearing.Svc/Do", req_type.DESCRIPTOR)

    def floor() -> None:
        copy = req_type()
        copy.CopyFrom(request)
        for line in copy.lines:
            line.ClearField("seen_at")

    for _ in sys.stdin:
        library = _common.best_of(lambda: fingerprint(request), repeat)
        least = _common.best_of(floor, repeat)
        print(json.dumps({"library_s": library, "floor_s": least}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=3, help="best of this many per round")
    parser.add_argument("--base", help="also measure this commit's src/, side by side")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.messages, args.repeat)
        return

    results = _common.source_rounds(
        __file__,
        ["--messages", str(args.messages), "--repeat", str(args.repeat)],
        args.base,
        args.rounds,
        "bench-clearing-",
    )
    print(f"{args.messages} small messages, best of {args.repeat}, median of {args.rounds} rounds")
    for label, rows in results.items():
        library = statistics.median(r["library_s"] for r in rows)
        least = statistics.median(r["floor_s"] for r in rows)
        print(
            f"{label:>16}: fingerprint {library * 1e3:8.1f} ms, floor {least * 1e3:7.1f} ms,"
            f" ratio {library / least:5.2f}, {library / args.messages * 1e6:5.2f} us a message"
        )


if __name__ == "__main__":
    main()
