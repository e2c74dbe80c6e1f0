"""Per-hop timestamps of a request through the services, for latency breakdowns.

With ``BATON_HOP_TRACE=1`` in a service's environment, ``mark(point)`` writes one line
``HOP <request id> <point> <CLOCK_MONOTONIC ns>`` to stderr (the clock is the machine's, so
lines from different processes compare); otherwise it does nothing but test a constant.
``benchmarks/hops.py`` runs a cluster with it and prints where a request's time goes.
"""

import os
import sys
import time

from shared.logs import request_id_var

ENABLED = os.environ.get("BATON_HOP_TRACE") == "1"


def mark(point: str, request_id: str | None = None) -> None:
    if ENABLED:
        rid = request_id or request_id_var.get()
        sys.stderr.write(f"HOP {rid} {point} {time.monotonic_ns()}\n")
