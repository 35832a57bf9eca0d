"""The ``protoc-gen-grpc-idempotency`` executable: a ``CodeGeneratorRequest`` on stdin, a
``CodeGeneratorResponse`` on stdout."""

from __future__ import annotations

import sys

from google.protobuf.message import DecodeError

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
    try:
        request = parse_request(sys.stdin.buffer.read())
    except DecodeError as err:
        # No protoc to hand an error to (CodeGeneratorResponse.error): whoever ran it by hand
        # gets the reason and the usage, not a traceback.
        print(
            f"protoc-gen-grpc-idempotency: standard input is not a CodeGeneratorRequest ({err})",
            file=sys.stderr,
        )
        print(USAGE, file=sys.stderr, end="")
        return 2
    sys.stdout.buffer.write(generate(request).SerializeToString())
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
