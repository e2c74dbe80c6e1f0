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
    return f"cuda:{rank}" if args.device == "cuda" else "cpu"


def prefill_side(args: argparse.Namespace, conn: "mp.connection.Connection") -> None:
    device = device_for(args, 0)
    if args.device == "cuda":
        torch.cuda.set_device(device)
    gen = torch.Generator(device=device).manual_seed(0)
    kv = torch.randn(cache_shape(args), dtype=torch.bfloat16, device=device, generator=gen)
    c = NixlConnector("bench-prefill", kv, "bench", "127.0.0.1")
    conn.send((c.side_channel, float(kv[: args.num_blocks - 1].float().sum().item())))
    while not conn.poll(0.001):
        c.poll()  # no progress thread: the passive side must be polled
    conn.recv()
    c.close()


def main() -> None:
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
    args = p.parse_args()
    if args.shape:
        for k, v in SHAPES[args.shape].items():
            setattr(args, k, v)
    nblocks = -(-args.tokens // args.block_size)
    args.num_blocks = nblocks + 1
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=prefill_side, args=(args, child), daemon=True)
    proc.start()
    side_channel, checksum = parent.recv()
    device = device_for(args, 1)
    if args.device == "cuda":
        torch.cuda.set_device(device)
    kv = torch.zeros(cache_shape(args), dtype=torch.bfloat16, device=device)
    c = NixlConnector("bench-decode", kv, "bench", "127.0.0.1")
    block_bytes = kv[0].numel() * kv.element_size()
    nbytes = nblocks * block_bytes
    remote = RemoteKV("bench-prefill", side_channel, list(range(nblocks)), args.tokens)
    times = []
    for i in range(args.repeats + 1):
        kv.zero_()
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        blocks = list(range(nblocks))
        assert not c.start_loads([KVLoad(f"r{i}", blocks, blocks, remote)])
        while True:
            res = c.poll(notifications=args.engine_poll)
            if res.finished or res.failed:
                break
        elapsed = time.perf_counter() - start
        assert res.finished, "the pull failed"
        if i:  # the first pull pays the connection set-up
            times.append(elapsed)
    got = float(kv[:nblocks].float().sum().item())
    copy = []
    if args.device == "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
        for i in range(args.repeats + 1):
            torch.cuda.synchronize("cuda:0")
            torch.cuda.synchronize("cuda:1")
            start = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize("cuda:1")
            if i:
                copy.append(time.perf_counter() - start)
    parent.send("done")
    proc.join(timeout=10)
    c.close()
    med = statistics.median(times)
    result = {
        "device": args.device,
        "tokens": args.tokens,
        "blocks": nblocks,
        "bytes": nbytes,
        "descriptors": nblocks,
        "nixl_read_ms_median": 1e3 * med,
        "nixl_read_gb_s": nbytes / med / 1e9,
        "bytes_match": abs(got - checksum) < 1e-3 * max(1.0, abs(checksum)),
    }
    if copy:
        cmed = statistics.median(copy)
        result["torch_copy_ms_median"] = 1e3 * cmed
        result["torch_copy_gb_s"] = nbytes / cmed / 1e9
        result["fraction_of_copy"] = cmed / med
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
