"""Pinning a service's threads to CPUs (Linux), and sharing CPUs out among a local cluster.

A service process runs its asyncio loop in one thread and gRPC's poller in another: a message
arriving wakes the poller, which wakes the loop. On an idle many-core machine each of those
wakes lands on whatever idle core the kernel picks, and waking an idle core is what a message
costs there (docs/performance.md, "Where the time goes": one core per service, 44–105 µs to
wake an idle core). With every thread of a service on one core, the poller hands the message
to the loop on the core it is already running on.

``--cpus`` on ``baton gateway | global-scheduler | worker`` pins the service once it serves
(a worker after its engine core process started, which keeps every CPU); ``baton serve
--pin-cpus`` gives each service of the local cluster a core of its own.
"""

import contextlib
import logging
import os
from collections.abc import Iterable, Sequence

logger = logging.getLogger(__name__)


def parse_cpus(spec: str) -> tuple[int, ...]:
    """A CPU list as ``taskset -c`` and cgroups write it: ``"3"``, ``"0,4-7"`` → sorted ids."""
    cpus: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ValueError(f"bad CPU list {spec!r}: expected ids and ranges like 0,4-7") from None
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {part!r} in {spec!r}")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def allowed_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on; a clear error where the OS cannot pin threads."""
    if not hasattr(os, "sched_getaffinity") or not os.path.isdir("/proc/self/task"):
        raise ValueError("CPU pinning needs Linux (sched_setaffinity and /proc)")
    return tuple(sorted(os.sched_getaffinity(0)))


def check_cpus(cpus: Iterable[int]) -> tuple[int, ...]:
    """``cpus``, if this process may run on all of them; else a ValueError naming the rest."""
    cpus = tuple(sorted(set(cpus)))
    allowed = allowed_cpus()
    if not cpus:
        raise ValueError("an empty CPU list")
    outside = sorted(set(cpus) - set(allowed))
    if outside:
        raise ValueError(f"CPUs {outside} are not available here (allowed: {format_cpus(allowed)})")
    return cpus


def pin_threads(cpus: Iterable[int]) -> int:
    """Pin every thread of this process to ``cpus`` and return how many there were. A thread
    started later inherits the mask of the thread that starts it, so it is pinned too; one
    started while this runs is caught by listing the threads again until none is new."""
    mask = set(check_cpus(cpus))
    done: set[int] = set()
    while new := {int(t) for t in os.listdir("/proc/self/task")} - done:
        for tid in new:
            with contextlib.suppress(ProcessLookupError):  # the thread ended in the meantime
                os.sched_setaffinity(tid, mask)
        done |= new
    logger.info("pinned %d threads to CPUs %s", len(done), format_cpus(mask))
    return len(done)


def assign_cpus(names: Sequence[str], spec: str) -> dict[str, int]:
    """A CPU for each of ``names`` (``baton serve --pin-cpus``).

    ``spec`` ``"auto"`` gives each a CPU of its own, the highest-numbered ones this process may
    use, and leaves at least one to everything else (the engine cores, which are never pinned).
    A CPU list is dealt out in order, round robin when it is shorter than ``names``."""
    allowed = allowed_cpus()
    if spec == "auto":
        if len(allowed) < len(names) + 1:
            raise ValueError(
                f"--pin-cpus: {len(names)} services need {len(names) + 1} CPUs (one each and one "
                f"for the engines); this process may use {len(allowed)} ({format_cpus(allowed)})"
            )
        pool = list(allowed[-len(names) :])
    else:
        pool = list(check_cpus(parse_cpus(spec)))
    return {name: pool[i % len(pool)] for i, name in enumerate(names)}


def format_cpus(cpus: Iterable[int]) -> str:
    """The inverse of ``parse_cpus``: ``(0, 4, 5, 6)`` → ``"0,4-6"``."""
    runs: list[str] = []
    for c in sorted(set(cpus)):
        if runs and c == int(runs[-1].rpartition("-")[2]) + 1:
            runs[-1] = f"{runs[-1].partition('-')[0]}-{c}"
        else:
            runs.append(str(c))
    return ",".join(runs)
