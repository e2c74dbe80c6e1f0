"""CPU pinning (``shared/affinity.py``): CPU lists, how ``baton serve --pin-cpus`` deals CPUs
out, and that pinning reaches every thread of a process, those started later included."""

import json
import os
import subprocess
import sys

import pytest

from shared import affinity
from shared.affinity import assign_cpus, check_cpus, format_cpus, parse_cpus

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux only")


def test_cpu_lists_parse_as_taskset_writes_them() -> None:
    assert parse_cpus("3") == (3,)
    assert parse_cpus("6-7, 0,2-3") == (0, 2, 3, 6, 7)
    assert format_cpus((0, 2, 3, 6, 7)) == "0,2-3,6-7"
    assert parse_cpus(format_cpus((1, 4, 5, 6, 9))) == (1, 4, 5, 6, 9)
    for bad in ("", "a", "3-1", "-1", "1,,2", "2-"):
        with pytest.raises(ValueError, match="CPU"):
            parse_cpus(bad)


def test_only_cpus_this_process_may_use() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    assert check_cpus([allowed[-1]]) == (allowed[-1],)
    with pytest.raises(ValueError, match=r"not available here \(allowed: "):
        check_cpus([max(allowed) + 1])


def test_auto_gives_each_service_a_cpu_of_its_own_and_leaves_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(affinity, "allowed_cpus", lambda: tuple(range(16)))
    names = ["scheduler", "worker-0", "worker-1", "gateway"]
    assert assign_cpus(names, "auto") == {
        "scheduler": 12, "worker-0": 13, "worker-1": 14, "gateway": 15,
    }  # fmt: skip
    monkeypatch.setattr(affinity, "allowed_cpus", lambda: (0, 1, 2, 3))
    with pytest.raises(ValueError, match="4 services need 5 CPUs"):
        assign_cpus(names, "auto")


def test_a_cpu_list_is_dealt_out_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(affinity, "allowed_cpus", lambda: tuple(range(8)))
    names = ["scheduler", "worker-0", "gateway"]
    assert assign_cpus(names, "5-7") == {"scheduler": 5, "worker-0": 6, "gateway": 7}
    assert assign_cpus(names, "2,4") == {"scheduler": 2, "worker-0": 4, "gateway": 2}
    with pytest.raises(ValueError, match="not available"):
        assign_cpus(names, "6-9")


_PIN = """
import json, os, sys, threading
from shared.affinity import pin_threads
stop = threading.Event()
for _ in range(3):
    threading.Thread(target=stop.wait, daemon=True).start()
n = pin_threads([int(sys.argv[1])])
later = threading.Thread(target=stop.wait, daemon=True)
later.start()
seen = {t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
late = sorted(os.sched_getaffinity(later.native_id))
print(json.dumps({"pinned": n, "threads": seen, "later": late}))
stop.set()
"""


def test_pinning_reaches_every_thread_and_those_started_later() -> None:
    cpu = max(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", _PIN, str(cpu)], capture_output=True,
                         text=True, check=True, timeout=60).stdout  # fmt: skip
    report = json.loads(out)
    assert report["pinned"] >= 4  # the main thread and the three started before
    assert len(report["threads"]) >= 5
    assert all(cpus == [cpu] for cpus in report["threads"].values()), report
    assert report["later"] == [cpu]
