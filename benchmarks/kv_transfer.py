"""KV transfer: one request's KV cache pulled between two processes over NIXL, next to a
torch copy of the same bytes in the same run.

The prefill side (a child process) allocates a KV cache shaped like the engine's (block
contiguous across layers, kv_cache/layout.py), fills it and serves the NIXL handshake; this
process (the decode side) pulls ``--tokens`` tokens' blocks with the engine's own
``NixlConnector`` (one READ, one descriptor per block), checks the bytes, and times it.

    python benchmarks/kv_transfer.py --shape llama-3.1-8b --tokens 2048          # GPU0 → GPU1
    python benchmarks/kv_transfer.py --layers 2 --kv-heads 2 --head-dim 16 --tokens 256  # CPU

On GPUs run with ``UCX_PROTO_INFO=y`` to see which transport UCX chose (``cuda_ipc`` expected).
"""

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.worker.engine.kv_transfer.nixl_connector import NixlConnector
from services.worker.engine.kv_transfer.params import KVLoad, RemoteKV

SHAPES = {"llama-3.1-8b": {"layers": 32, "kv_heads": 8, "head_dim": 128}}


def cache_shape(args: argparse.Namespace) -> tuple[int, ...]:
    return (args.num_blocks, args.layers, 2, args.block_size, args.kv_heads, args.head_dim)


def device_for(args: argparse.Namespace, rank: int) -> str:
    if args.device != "cuda":
        return "cpu"
    return "cuda:0" if args.isolate else f"cuda:{rank}"


def expected(args: argparse.Namespace) -> torch.Tensor:
    """The prefill side's cache contents (on the CPU: both sides can compute them)."""
    gen = torch.Generator().manual_seed(0)
    return torch.randn(cache_shape(args), generator=gen).to(torch.bfloat16)


def prefill_side(args: argparse.Namespace, conn: "mp.connection.Connection") -> None:
    if args.isolate:
        os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    device = device_for(args, 0)
    if args.device == "cuda":
        torch.cuda.set_device(device)
    kv = expected(args).to(device)
    c = NixlConnector("bench-prefill", kv, "bench", "127.0.0.1")
    conn.send((c.side_channel, float(kv[: args.num_blocks - 1].float().sum().item())))
    while True:
        while not conn.poll(args.peer_poll_ms / 1e3):
            c.poll()  # no progress thread: the passive side must be polled
        msg = conn.recv()
        if msg[0] == "write":  # push our blocks into the decode side's cache, timed here
            _, side_channel, src, dst = msg
            conn.send(timed_pulls(c, "WRITE", side_channel, src, dst, args.repeats))
        else:
            break
    c.close()


def timed_pulls(
    c: NixlConnector,
    op: str,
    side_channel: str,
    local: list[int],
    remote: list[int],
    repeats: int,
    merged: bool = False,
    notify: str = "",
) -> dict[str, list[float]]:
    """``repeats`` + 1 transfers straight on the connector's agent (the first, which pays the
    connection set-up, is dropped), each timed in three parts: make the request, post it,
    wait for DONE. ``merged``: one descriptor per run of consecutive blocks, built with numpy
    per request, instead of the prepared one-per-block lists. ``notify``: "xfer" attaches
    the release notification to the transfer (NIXL sends it on completion), "send" sends it
    after DONE (a separate message)."""
    import numpy as np

    peer = c._peer(RemoteKV("peer", side_channel, remote, 0))
    info = peer.info
    times: dict[str, list[float]] = {"make": [], "post": [], "wait": [], "total": []}
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        if merged:
            lo, ro = np.asarray(local), np.asarray(remote)
            starts = np.flatnonzero(np.r_[True, (np.diff(lo) != 1) | (np.diff(ro) != 1)])
            lens = np.diff(np.r_[starts, len(lo)]) * c.block_bytes
            ldesc = np.stack([c.kv_cache.data_ptr() + lo[starts] * c.block_bytes, lens,
                              np.full_like(lens, c.device_id)], axis=1)  # fmt: skip
            rdesc = np.stack([info.base_address + ro[starts] * info.block_bytes, lens,
                              np.full_like(lens, info.device_id)], axis=1)  # fmt: skip
            handle = c.agent.initialize_xfer(
                op, c.agent.get_xfer_descs(ldesc, c.mem_type),
                c.agent.get_xfer_descs(rdesc, info.mem_type), peer.name,
            )  # fmt: skip
        else:
            handle = c.agent.make_prepped_xfer(
                op, c._local, np.asarray(local, dtype=np.int64), peer.remote_dlist,
                np.asarray(remote, dtype=np.int64),
                notif_msg=f"bench:{i}".encode() if notify == "xfer" else b"",
            )  # fmt: skip
        t1 = time.perf_counter()
        state = c.agent.transfer(handle)
        t2 = time.perf_counter()
        while state == "PROC":
            state = c.agent.check_xfer_state(handle)
        t3 = time.perf_counter()
        assert state == "DONE", state
        if notify == "send":
            c.agent.send_notif(peer.name, f"bench:{i}".encode())
            t3 = time.perf_counter()
        c.agent.release_xfer_handle(handle)
        if i:
            for k, v in (("make", t1 - t0), ("post", t2 - t1), ("wait", t3 - t2),
                         ("total", t3 - t0)):  # fmt: skip
                times[k].append(v)
    return times


def main() -> None:
    if "--isolate" in sys.argv:  # before anything here initialises CUDA (argparse's default does)
        os.environ["CUDA_VISIBLE_DEVICES"] = "1"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default=None)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=10)
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    p.add_argument("--device", choices=["cuda", "cpu"], default=default_device)
    p.add_argument("--out", default=None)
    p.add_argument(
        "--engine-poll",
        action="store_true",
        help="poll as an engine step does (transfer states + notifications)",
    )
    p.add_argument("--step-ms", type=float, default=0.0, help="also: one poll per step of this")
    p.add_argument("--peer-poll-ms", type=float, default=1.0, help="the prefill side's poll period")
    p.add_argument(
        "--isolate",
        action="store_true",
        help="each side sees only its own GPU (CUDA_VISIBLE_DEVICES), as baton serve runs them",
    )
    args = p.parse_args()
    if args.shape:
        for k, v in SHAPES[args.shape].items():
            setattr(args, k, v)
    nblocks = -(-args.tokens // args.block_size)
    args.num_blocks = 2 * nblocks + 1  # room for a scattered placement too
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=prefill_side, args=(args, child), daemon=True)
    proc.start()
    side_channel, _ = parent.recv()
    device = device_for(args, 1)
    if args.device == "cuda":
        torch.cuda.set_device(device)
    kv = torch.zeros(cache_shape(args), dtype=torch.bfloat16, device=device)
    c = NixlConnector("bench-decode", kv, "bench", "127.0.0.1")
    block_bytes = kv[0].numel() * kv.element_size()
    nbytes = nblocks * block_bytes
    blocks = list(range(nblocks))
    # what a busy engine's free queue hands out: every other block, in a shuffled order
    scattered = random.Random(0).sample(range(0, 2 * nblocks, 2), nblocks)
    result: dict = {"device": args.device, "tokens": args.tokens, "blocks": nblocks,
                    "bytes": nbytes, "block_bytes": block_bytes}  # fmt: skip

    # 1. the engine's own path: NixlConnector.start_loads + poll, bytes checked
    remote = RemoteKV("bench-prefill", side_channel, blocks, args.tokens)
    times = []
    for i in range(args.repeats + 1):
        kv.zero_()
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        assert not c.start_loads([KVLoad(f"r{i}", blocks, blocks, remote)])
        while True:
            res = c.poll(notifications=args.engine_poll)
            if res.finished or res.failed:
                break
        elapsed = time.perf_counter() - start
        assert res.finished, "the pull failed"
        if i:  # the first pull pays the connection set-up
            times.append(elapsed)
    result["bytes_match"] = bool(torch.equal(kv[:nblocks].cpu(), expected(args)[:nblocks]))
    result["connector_read_ms"] = 1e3 * statistics.median(times)
    if args.step_ms:  # polled once per engine step, into scattered blocks: as in serving
        steps = []
        for i in range(args.repeats):
            start = time.perf_counter()
            assert not c.start_loads([KVLoad(f"s{i}", scattered, blocks, remote)])
            n = 0
            while True:
                time.sleep(args.step_ms / 1e3)  # the model's forward
                n += 1
                res = c.poll()
                if res.finished or res.failed:
                    break
            assert res.finished
            steps.append((time.perf_counter() - start, n))
        result["engine_cadence"] = {
            "step_ms": args.step_ms,
            "pull_ms": 1e3 * statistics.median(t for t, _ in steps),
            "steps": statistics.median(n for _, n in steps),
            "UCX_CUDA_IPC_MAX_POLL": os.environ.get("UCX_CUDA_IPC_MAX_POLL"),
        }

    # 2. variants on the bare agent, each timed as make / post / wait
    variants: dict[str, tuple] = {
        "read_prepped": ("READ", blocks, blocks, False),
        "read_merged": ("READ", blocks, blocks, True),
        "read_prepped_scattered": ("READ", scattered, blocks, False),
        "read_prepped_notif_on_xfer": ("READ", blocks, blocks, False, "xfer"),
        "read_prepped_then_send_notif": ("READ", blocks, blocks, False, "send"),
    }
    for name, (op, local, rem, merged, *notify) in variants.items():
        t = timed_pulls(c, op, side_channel, local, rem, args.repeats, merged, *notify)
        result[name] = {f"{k}_ms": 1e3 * statistics.median(v) for k, v in t.items()}
    parent.send(("write", c.side_channel, blocks, blocks))
    while not parent.poll(0.001):
        c.poll()  # the passive side, polled as the child was
    t = parent.recv()
    result["write_prepped"] = {f"{k}_ms": 1e3 * statistics.median(v) for k, v in t.items()}

    # 3. the same bytes copied by torch, GPU 0 → GPU 1
    if args.device == "cuda" and not args.isolate:
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
        copy = []
        for i in range(args.repeats + 1):
            torch.cuda.synchronize("cuda:0")
            torch.cuda.synchronize("cuda:1")
            start = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize("cuda:1")
            if i:
                copy.append(time.perf_counter() - start)
        result["torch_copy_ms"] = 1e3 * statistics.median(copy)
        result["torch_copy_gb_s"] = nbytes / statistics.median(copy) / 1e9
    parent.send(("stop",))
    proc.join(timeout=10)
    c.close()
    base = result.get("torch_copy_ms")
    for key in ("connector_read_ms", *variants, "write_prepped"):
        ms = result[key] if key.endswith("_ms") else result[key]["total_ms"]
        line = f"{key:30s} {ms:8.3f} ms  {nbytes / ms / 1e6:7.1f} GB/s"
        if base:
            line += f"  {base / ms:6.1%} of the copy"
        print(line)
    if base:
        print(f"{'torch copy':30s} {base:8.3f} ms  {result['torch_copy_gb_s']:7.1f} GB/s")
        result["fraction_of_copy"] = base / result["connector_read_ms"]
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
