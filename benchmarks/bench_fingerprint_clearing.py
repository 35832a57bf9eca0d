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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _request_type() -> Any:
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    from grpc_idempotency.v1 import options_pb2

    field = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(
        name="bench_clearing.proto", package="benchclearing", syntax="proto3"
    )
    fdp.dependency.append("grpc_idempotency/v1/options.proto")
    meta = fdp.message_type.add(name="Meta")
    meta.field.add(name="trace", number=1, type=field.TYPE_STRING, label=field.LABEL_OPTIONAL)
    line = fdp.message_type.add(name="Line")
    line.field.add(name="amount", number=1, type=field.TYPE_INT64, label=field.LABEL_OPTIONAL)
    seen_at = line.field.add(
        name="seen_at", number=2, type=field.TYPE_INT64, label=field.LABEL_OPTIONAL
    )
    extensions: Any = seen_at.options.Extensions
    extensions[options_pb2.field].fingerprint = options_pb2.FINGERPRINT_EXCLUDE
    line.field.add(
        name="meta", number=3, type=field.TYPE_MESSAGE, type_name=".benchclearing.Meta",
        label=field.LABEL_OPTIONAL,
    )  # fmt: skip
    req = fdp.message_type.add(name="Req")
    req.field.add(
        name="lines", number=1, type=field.TYPE_MESSAGE, type_name=".benchclearing.Line",
        label=field.LABEL_REPEATED,
    )  # fmt: skip
    pool = descriptor_pool.Default()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("benchclearing.Req"))


def _best(work: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return best


def child(messages: int, repeat: int) -> None:
    """Measures on "go" lines from stdin, one JSON line each (this process's ``src/``)."""
    from grpc_idempotency.core.fingerprint import Fingerprinter

    req_type = _request_type()
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
        library = _best(lambda: fingerprint(request), repeat)
        least = _best(floor, repeat)
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
    sys.path.insert(0, str(HERE))
    import _common

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
