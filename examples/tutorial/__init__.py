"""The README's five-minute tutorial as a program: ``python -m examples.tutorial [--dsn DSN]``.

``payments.proto`` declares a keyed ``PaymentService.Charge``; ``server.py`` serves it behind
``IdempotencyInterceptor``; ``client.py`` charges once and retries with the same key, and the
retry is replayed. ``__main__.py`` ties them together on an embedded PostgreSQL. Runs from a
checkout (``examples/`` is not part of the wheel) and needs only the package with two extras:
``pip install -e '.[codegen,embedded]'``.
"""
