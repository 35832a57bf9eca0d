#!/usr/bin/env bash
# Regenerates the test PKI (a CA, a server certificate for localhost, two client certificates),
# valid for 100 years: tests/integration/test_tls_scope.py uses it. Run from this directory.
set -euo pipefail
days=36500
openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days $days \
    -subj "/CN=grpc-idempotency test CA" 2>/dev/null
issue() {  # name, subjectAltName
    openssl req -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "/CN=$1" 2>/dev/null
    printf 'subjectAltName=%s\n' "$2" >"$1.ext"
    openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -out "$1.crt" \
        -days $days -extfile "$1.ext" 2>/dev/null
    rm -f "$1.csr" "$1.ext"
}
issue server "DNS:localhost,IP:127.0.0.1"
issue alice "DNS:alice.clients.example"
issue bob "DNS:bob.clients.example"
rm -f ca.key ca.srl  # nothing else is ever signed with it
