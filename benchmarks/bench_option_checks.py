#!/usr/bin/env python
"""Compiling a keyed method's policy in a big descriptor pool: two versions side by side.

    cd /work/main
    PYTHONPATH=. .venv/bin/python benchmarks/bench_option_checks.py --base <commit> [--rounds 7]
        [--types 400] [--extensions 5000]

``compile_policy`` checks the ``(grpc_idempotency.v1.field)`` options of every message type a
request reaches and of the extensions the pool holds of them (``core.fingerprint``,
``core.option_checks``). A method the server was not given at construction is compiled on its
first call, on the event loop: what this costs in a pool of many types and extensions is the
figure here. No gRPC, no database.

Each round builds, in a fresh ``DescriptorPool`` (outside the timing), for each shape:

- **proto2**: a request holding a tree of ``--types`` proto2 message types, each with an
  extension range (so each may be extended), one in 50 with a FINGERPRINT_EXCLUDE field; then
  ``--extensions`` extensions of those types (100 per file, one in 10 of a message type), or
  none (the control).
- **proto3**: the same tree in proto3 (no extension ranges, so no extensions of them), and the
  extensions are of as many proto2 types in the pool that no request reaches.

and 20 keyed methods, each with a request type of its own holding the tree. Timed: the first
method's ``compile_policy`` (nothing compiled yet in that pool: a server's first lazily compiled
method), then each other method's (the tree's types compiled before: the median); then, in
another fresh pool, ``compile_policies`` of all 20 (what a server given the service compiles at
start), the whole. Each version runs in a process of its own (``git archive <commit> src``,
and the working tree's ``src/``), rounds alternating; per version, the median of the rounds;
working tree / base paired round by round.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys

import _common

REPO = _common.HERE.parent

CHILD = r"""
import gc, json, statistics, sys, time
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_idempotency.core.policy import compile_policies, compile_policy
from grpc_idempotency.v1 import options_pb2

FDP = descriptor_pb2.FieldDescriptorProto
OPT = FDP.LABEL_OPTIONAL
TYPES, EXTENSIONS, METHODS = int(sys.argv[1]), int(sys.argv[2]), 20


def excluded(field):
    field.options.Extensions[options_pb2.field].fingerprint = options_pb2.FINGERPRINT_EXCLUDE


def add_with_imports(pool, file):
    for dependency in file.dependencies:
        add_with_imports(pool, dependency)
    try:
        pool.FindFileByName(file.name)
    except KeyError:
        pool.AddSerializedFile(file.serialized_pb)


def build(shape, extensions):
    pool = descriptor_pool.DescriptorPool()
    add_with_imports(pool, options_pb2.DESCRIPTOR)
    syntax = "proto2" if shape == "proto2" else "proto3"
    label = OPT
    tree = descriptor_pb2.FileDescriptorProto(name="big/tree.proto", package="big", syntax=syntax)
    tree.dependency.append(options_pb2.DESCRIPTOR.name)
    for i in range(TYPES):
        m = tree.message_type.add(name=f"T{i}")
        if shape == "proto2":
            m.extension_range.add(start=1000, end=536870911)
        m.field.add(name="s", number=1, type=FDP.TYPE_STRING, label=label)
        if i % 50 == 0:
            excluded(m.field.add(name="note", number=2, type=FDP.TYPE_STRING, label=label))
        for number, child in ((3, 2 * i + 1), (4, 2 * i + 2)):
            if child < TYPES:
                m.field.add(
                    name=f"c{number}", number=number, type=FDP.TYPE_MESSAGE,
                    type_name=f".big.T{child}", label=label,
                )
    files = [tree]
    extendee = "big"
    if shape == "proto3":
        # The extensions are of types no request reaches.
        other = descriptor_pb2.FileDescriptorProto(
            name="big/other.proto", package="big.other", syntax="proto2"
        )
        for i in range(TYPES):
            other.message_type.add(name=f"T{i}").extension_range.add(start=1000, end=536870911)
        files.append(other)
        extendee = "big.other"
    held = descriptor_pb2.FileDescriptorProto(
        name="big/held.proto", package="big.held", syntax="proto2"
    )
    held.message_type.add(name="Held").field.add(
        name="v", number=1, type=FDP.TYPE_STRING, label=OPT
    )
    files.append(held)
    for j in range(extensions // 100):
        f = descriptor_pb2.FileDescriptorProto(
            name=f"big/ext{j}.proto", package=f"big.ext{j}", syntax="proto2",
            dependency=[files[-2].name, held.name],
        )
        for k in range(100):
            n = j * 100 + k
            ext = f.extension.add(
                name=f"x{k}", number=1000 + n, label=OPT, extendee=f".{extendee}.T{n % TYPES}",
                type=FDP.TYPE_STRING,
            )
            if n % 10 == 0:
                ext.type, ext.type_name = FDP.TYPE_MESSAGE, ".big.held.Held"
        files.append(f)
    svc = descriptor_pb2.FileDescriptorProto(name="big/svc.proto", package="big.svc", syntax=syntax)
    svc.dependency.extend([tree.name, options_pb2.DESCRIPTOR.name])
    service = svc.service.add(name="Svc")
    for j in range(METHODS):
        r = svc.message_type.add(name=f"R{j}")
        r.field.add(name="tree", number=1, type=FDP.TYPE_MESSAGE, type_name=".big.T0", label=label)
        m = service.method.add(
            name=f"M{j}", input_type=f".big.svc.R{j}", output_type=f".big.svc.R{j}"
        )
        m.options.Extensions[options_pb2.method].SetInParent()
    files.append(svc)
    for f in files:
        pool.Add(f)
    return pool.FindServiceByName("big.svc.Svc").methods


def timed(method):
    started = time.perf_counter()
    policy = compile_policy(method)
    elapsed = time.perf_counter() - started
    assert policy is not None and policy.fingerprint.excludes_anything
    return elapsed * 1e3


for line in sys.stdin:
    out = {}
    for shape in ("proto2", "proto3"):
        for n in (0, EXTENSIONS):
            methods = build(shape, n)
            gc.collect()
            out[f"{shape} {n} first"] = timed(methods[0])
            out[f"{shape} {n} other"] = statistics.median(timed(m) for m in methods[1:])
            methods = build(shape, n)
            gc.collect()
            started = time.perf_counter()
            assert len(compile_policies(methods)) == METHODS
            out[f"{shape} {n} all"] = (time.perf_counter() - started) * 1e3
    print(json.dumps(out), flush=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the commit to compare the working tree with")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--types", type=int, default=400)
    parser.add_argument("--extensions", type=int, default=5000)
    args = parser.parse_args()
    base, work = _common.export(args.base, "bench-option-checks-")
    try:
        procs = {}
        for name, src in ((f"base {base}", work / "src"), ("working tree", REPO / "src")):
            procs[name] = subprocess.Popen(
                [sys.executable, "-c", CHILD, str(args.types), str(args.extensions)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ, "PYTHONPATH": str(src)},
            )
        names = list(procs)
        results = _common.interleaved_rounds(procs, args.rounds)
        for p in procs.values():
            assert p.stdin is not None
            p.stdin.close()
            p.wait(timeout=30)
        print(
            f"bench_option_checks: base {base} vs the working tree; {args.rounds} rounds;"
            f" a request reaching {args.types} message types; ms per compile_policy (first,"
            " other) or for compile_policies of 20 methods (all); median of the rounds"
        )
        print(f"\n  {'pool':<32} {'method':<7} {names[0]:>14} {names[1]:>14}  tree/base")
        for key in results[names[0]][0]:
            shape, n, which = key.split()
            pool = f"{shape}, {n} extensions"
            base_ms, tree_ms = (statistics.median(x[key] for x in results[name]) for name in names)
            ratio = statistics.median(
                t[key] / b[key] for t, b in zip(results[names[1]], results[names[0]], strict=True)
            )
            print(f"  {pool:<32} {which:<7} {base_ms:14.2f} {tree_ms:14.2f}  {ratio:9.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
