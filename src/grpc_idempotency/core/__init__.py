"""Sans-I/O decisions: keys, scopes, fingerprints, policies and the key lifecycle.

Nothing in this package imports grpc, asyncio, asyncpg or OpenTelemetry: it decides, and the
drivers (server interceptor, store, consumers) carry the decisions out.
"""
