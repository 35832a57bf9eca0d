"""``python -m tests.e2e.checkout_with_timeout SECONDS ARGS...``: ``python -m examples.checkout
ARGS...`` with the orders service's bound on each downstream call
(``examples.checkout.orders.DOWNSTREAM_TIMEOUT_S``, read at each call) set to SECONDS, for a
test that waits that bound out: the example's own (10 s) made the test wait 10 s for nothing but
a timer. The example's code runs unchanged."""

from __future__ import annotations

import runpy
import sys

from examples.checkout import orders

if __name__ == "__main__":
    orders.DOWNSTREAM_TIMEOUT_S = float(sys.argv.pop(1))
    runpy.run_module("examples.checkout", run_name="__main__", alter_sys=True)
