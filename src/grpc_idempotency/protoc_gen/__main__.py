"""The ``protoc-gen-grpc-idempotency`` executable: a ``CodeGeneratorRequest`` on stdin, a
``CodeGeneratorResponse`` on stdout."""

from __future__ import annotations

import sys

from grpc_idempotency.protoc_gen import generate
from grpc_idempotency.protoc_gen.pool import parse_request

USAGE = """\
protoc-gen-grpc-idempotency is a protoc plugin; protoc runs it. For example:

  python -m grpc_tools.protoc -I protos -I "$(grpc-idempotency include-path)" \\
      --python_out=gen --pyi_out=gen --grpc-idempotency_out=gen protos/pkg/v1/service.proto

or, with buf, a buf.gen.yaml plugin entry `local: protoc-gen-grpc-idempotency`.
"""


def main() -> int:
    if sys.argv[1:] or sys.stdin.isatty():
        print(USAGE, file=sys.stderr, end="")
        return 0 if {"-h", "--help"} & set(sys.argv[1:]) else 2
    request = parse_request(sys.stdin.buffer.read())
    sys.stdout.buffer.write(generate(request).SerializeToString())
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
