"""A bare HTTP/2 client for one unary gRPC call with arbitrary header bytes.

gRPC clients refuse to send metadata values outside printable ASCII, but nothing stops another
client on the wire, and the gRPC server passes such values to the application. This sends them.
"""

from __future__ import annotations

import socket

import h2.config
import h2.connection
import h2.events


def unary_call(
    port: int, path: str, message: bytes, headers: list[tuple[bytes, bytes]], timeout: float = 5.0
) -> dict[bytes, bytes]:
    """Sends one call; returns the response headers and trailers merged (grpc-status etc.)."""
    answer: dict[bytes, bytes] = {}
    for block in unary_frames(port, path, message, headers, timeout):
        answer.update(block)
    return answer


def unary_frames(
    port: int, path: str, message: bytes, headers: list[tuple[bytes, bytes]], timeout: float = 5.0
) -> list[dict[bytes, bytes]]:
    """Sends one call; returns the response's header blocks as they came, in order: one for a
    trailers-only answer (nothing sent before the status), else the headers, then the trailers.
    What a grpc-java client hands to ``onHeaders`` and what to ``onClose`` is decided here,
    which a C-core client's initial and trailing metadata do not show apart for an answer with
    empty headers."""
    config = h2.config.H2Configuration(
        client_side=True,
        header_encoding=None,
        validate_outbound_headers=False,
        normalize_outbound_headers=False,
    )
    conn = h2.connection.H2Connection(config)
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        conn.initiate_connection()
        request_headers = [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", path.encode()),
            (b":authority", b"localhost"),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
            *headers,
        ]
        conn.send_headers(1, request_headers)
        framed = b"\x00" + len(message).to_bytes(4, "big") + message
        conn.send_data(1, framed, end_stream=True)
        sock.sendall(conn.data_to_send())
        blocks: list[dict[bytes, bytes]] = []
        while True:
            data = sock.recv(65535)
            if not data:
                return blocks
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                    blocks.append(dict(event.headers))
                if isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                    return blocks
            sock.sendall(conn.data_to_send())
