"""What grows in the gateway's memory during a soak: its memory by kind over time, taken inside
the gateway process, and tracemalloc's diff between two snapshots of its Python heap.

``soak.py --memory-s N`` starts ``baton serve`` with a ``sitecustomize`` (``hook_dir``) on its
children's path that calls ``start_if_gateway``: in the gateway process only, a thread appends
one line to ``memory.jsonl`` every N seconds: the process's RSS (anonymous, file-backed, and in
malloc's main heap), glibc malloc's bytes in use and free over all its arenas (``mallinfo2``:
what C and Rust extensions allocate, which tracemalloc does not see, and the allocator's free
space), pymalloc's arenas and the bytes of objects in them (``sys._debugmallocstats``, appended
to ``pymalloc.txt``; it writes to the process's stderr, so a log line written in that
millisecond lands there too; none while tracemalloc runs) and the requests the gateway has
counted so far. With ``--tracemalloc`` it also starts tracemalloc once the warm-up is over, so
that a snapshot holds only what was allocated since and is still alive (cheap to take, and
exactly the candidates for a leak), and at each line collects garbage and dumps a snapshot
(``snap-<seconds>.tm``). The product's code is not touched. Then

    python benchmarks/gateway_memory.py OUT/memory

prints the lines, the slope of each kind of memory over the run after its warm-up (MiB a
minute, least squares, and bytes per request) and, with snapshots, the allocation sites that
grew between the second snapshot (the first holds none of the requests then in flight) and the
last one (``Snapshot.compare_to(..., "traceback")``).
"""

import argparse
import ctypes
import gc
import json
import os
import re
import sys
import threading
import time
import tracemalloc
from pathlib import Path

# read by the soak's hook only, never by the product
DIR_ENV = "BATON_SOAK_MEMORY_DIR"  # where the gateway writes memory.jsonl (unset: nothing)
EVERY_ENV = "BATON_SOAK_MEMORY_S"  # seconds between two lines
TRACE_AFTER_ENV = "BATON_SOAK_TRACEMALLOC_AFTER_S"  # tracemalloc from then on (unset: never)
FRAMES = 12
_IGNORED = (tracemalloc.__file__, "<frozen importlib._bootstrap>",
            "<frozen importlib._bootstrap_external>", __file__)  # fmt: skip


def hook_dir(root: Path) -> Path:
    """A folder holding a ``sitecustomize`` that calls ``start_if_gateway``: put it and the
    repository first on a child's PYTHONPATH."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "sitecustomize.py").write_text(
        "from benchmarks.gateway_memory import start_if_gateway\nstart_if_gateway()\n"
    )
    return root


def start_if_gateway() -> None:
    """In ``baton gateway`` with the soak's variables set: the recording thread."""
    argv = sys.orig_argv
    is_gateway = "baton.cli" in argv and argv[argv.index("baton.cli") + 1 :][:1] == ["gateway"]
    if not is_gateway or not os.environ.get(DIR_ENV):
        return
    out = Path(os.environ[DIR_ENV])
    out.mkdir(parents=True, exist_ok=True)
    every_s = float(os.environ.get(EVERY_ENV, "30"))
    after = os.environ.get(TRACE_AFTER_ENV)
    trace_after_s = float(after) if after else None
    threading.Thread(target=_record, args=(out, every_s, trace_after_s), daemon=True,
                     name="soak-memory").start()  # fmt: skip


def _record(out: Path, every_s: float, trace_after_s: float | None) -> None:
    start = time.monotonic()
    while True:
        t = round(time.monotonic() - start)
        if trace_after_s is not None and t >= trace_after_s and not tracemalloc.is_tracing():
            tracemalloc.start(FRAMES)
        line: dict[str, float] = {"t": t, "requests": _requests()}
        if tracemalloc.is_tracing():
            gc.collect()  # what is left is reachable, not garbage waiting for a collection
            snap = tracemalloc.take_snapshot().filter_traces(
                [tracemalloc.Filter(False, f) for f in _IGNORED]
            )
            snap.dump(str(out / f"snap-{t:05d}.tm"))
            line["heap_mb"] = tracemalloc.get_traced_memory()[0] / 2**20
        line.update(**_rss(), **_malloc(), **_pymalloc(out / "pymalloc.txt", t))
        with open(out / "memory.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        time.sleep(every_s)


def _requests() -> float:
    """Requests the gateway has answered (``baton_gateway_requests``, every outcome)."""
    from prometheus_client import REGISTRY

    return sum(
        s.value for m in REGISTRY.collect() if m.name == "baton_gateway_requests"
        for s in m.samples if s.name.endswith("_total")
    )  # fmt: skip


def _rss() -> dict[str, float]:
    """RSS, its anonymous (heaps, arenas, stacks) and file-backed parts, and the part of it in
    malloc's main heap (``[heap]``, grown with brk: the main thread's allocations), from /proc."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) / 1024
    brk_kb, mapping = 0, ""
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if not line[:1].isupper():  # a mapping's first line: "start-end perms ... [name]"
            mapping = line
        elif line.startswith("Rss:") and mapping.endswith("[heap]"):
            brk_kb += int(line.split()[1])
    return {"rss_mb": fields.get("VmRSS", 0), "anon_mb": fields.get("RssAnon", 0),
            "file_mb": fields.get("RssFile", 0), "brk_heap_mb": brk_kb / 1024}  # fmt: skip


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


def _malloc() -> dict[str, float]:
    """glibc malloc over all its arenas: bytes handed out and not freed (``uordblks``), bytes
    free inside its heaps (``fordblks``: fragmentation, when it grows) and in mmapped chunks."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):  # not glibc, or older than 2.33
        return {}
    m = libc.mallinfo2()
    return {"malloc_used_mb": m.uordblks / 2**20, "malloc_free_mb": m.fordblks / 2**20,
            "malloc_mmap_mb": m.hblkhd / 2**20}  # fmt: skip


def _pymalloc(path: Path, t: float) -> dict[str, float]:
    """pymalloc's arenas (the memory it holds from the system) and the bytes of objects in
    them, from ``sys._debugmallocstats`` (its text appended to ``path``)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "a+") as f:
        f.write(f"\n=== t={t}\n")
        f.flush()
        at = f.tell()
        os.dup2(f.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(at)
        text = f.read()
    used = re.search(r"# bytes in allocated blocks\s*=\s*([\d,]+)", text)
    total = re.search(r"\nTotal\s*=\s*([\d,]+)", text)
    if used is None or total is None:
        return {}
    return {"pymalloc_used_mb": int(used[1].replace(",", "")) / 2**20,
            "pymalloc_arenas_mb": int(total[1].replace(",", "")) / 2**20}  # fmt: skip


def compare(folder: Path, after_s: float | None, until_s: float | None, top: int) -> dict:
    """Slopes (MiB a minute, fitted) from the first line at or after ``after_s`` (None: the second
    snapshot, or without snapshots a fifth of the run) to the last one up to ``until_s``, and the
    allocation sites that grew between the snapshots taken then, when there are some."""
    lines = [json.loads(x) for x in (folder / "memory.jsonl").read_text().splitlines()]
    traced = [x for x in lines if "heap_mb" in x]
    if after_s is None:  # (the first fifth of the run is the warm-up)
        after_s = traced[1]["t"] if len(traced) > 1 else lines[-1]["t"] / 5
    span = [x for x in lines if x["t"] >= after_s and (until_s is None or x["t"] <= until_s)]
    first, last = span[0], span[-1]
    requests = max(last["requests"] - first["requests"], 1)
    minutes = max((last["t"] - first["t"]) / 60, 1e-9)
    slope = {k: round(_fit(span, k), 4) for k in last if k.endswith("_mb") and k in first}
    per_request = {k: round(2**20 * v * minutes / requests, 1) for k, v in slope.items()}
    sites = []
    if "heap_mb" in first and "heap_mb" in last:
        old = tracemalloc.Snapshot.load(str(folder / f"snap-{first['t']:05d}.tm"))
        new = tracemalloc.Snapshot.load(str(folder / f"snap-{last['t']:05d}.tm"))
        for stat in new.compare_to(old, "traceback")[:top]:
            frames = [f"{_short(f.filename)}:{f.lineno}" for f in stat.traceback]
            sites.append({"size_diff_kb": round(stat.size_diff / 1024, 1), "size_kb":
                          round(stat.size / 1024, 1), "count_diff": stat.count_diff,
                          "bytes_per_request": round(stat.size_diff / requests, 2),
                          "traceback": frames})  # fmt: skip
    return {"from_s": first["t"], "to_s": last["t"], "requests": requests,
            "mb_per_min": slope, "bytes_per_request": per_request, "lines": lines,
            "sites": sites}  # fmt: skip


def _short(path: str) -> str:
    """A frame's file as its package, Baton's folder or the stdlib names it."""
    if "site-packages/" in path:
        return path.rsplit("site-packages/", 1)[1]
    for folder in ("/services/", "/shared/", "/baton/", "/lib/python3"):
        if folder in path:
            return folder[1:] + path.rsplit(folder, 1)[1]
    return path


def _fit(lines: list[dict], key: str) -> float:
    """MiB a minute: the least-squares slope of ``key`` over time (a sample's ups and downs,
    RSS's in steps of pages, weigh less than between the first and the last)."""
    points = [(x["t"] / 60, x[key]) for x in lines if key in x]
    if len(points) < 2:
        return 0.0
    mt = sum(t for t, _ in points) / len(points)
    mv = sum(v for _, v in points) / len(points)
    var = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (v - mv) for t, v in points) / var if var else 0.0


COLUMNS = ("rss_mb", "anon_mb", "brk_heap_mb", "malloc_used_mb", "malloc_free_mb",
           "pymalloc_arenas_mb", "pymalloc_used_mb", "heap_mb")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("folder", type=Path, help="the gateway's records (soak.py's OUT/memory)")
    p.add_argument(
        "--after-s",
        type=float,
        default=None,
        help="from the first line at or after this (default: the second snapshot)",
    )
    p.add_argument("--until-s", type=float, default=None, help="to the last line up to this")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = p.parse_args()
    result = compare(args.folder, args.after_s, args.until_s, args.top)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print("t(s) requests " + " ".join(c.removesuffix("_mb") for c in COLUMNS) + " (MiB)")
    for x in result["lines"]:
        print(f"{x['t']:5.0f} {x['requests']:8.0f} "
              + " ".join(f"{x[c]:.2f}" if c in x else "-" for c in COLUMNS))  # fmt: skip
    print(
        f"{result['from_s']} s → {result['to_s']} s, {result['requests']:.0f} requests; "
        f"MiB/min: {result['mb_per_min']}; bytes/request: {result['bytes_per_request']}"
    )
    for s in result["sites"]:
        print(f"\n{s['size_diff_kb']:+.1f} KiB ({s['bytes_per_request']:+.2f} B/request, "
              f"{s['count_diff']:+d} blocks; now {s['size_kb']} KiB)")  # fmt: skip
        for frame in s["traceback"]:
            print(f"    {frame}")


if __name__ == "__main__":
    main()
