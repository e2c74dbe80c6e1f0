"""A tensor-parallel rank in its own process (``MultiprocExecutor`` starts one per rank).

It reads its ``EngineConfig`` as JSON on stdin, joins the group, loads its shard of the model,
says it is up (``RankReply(seq=0)``), then answers calls from a ZMQ PULL socket until
``Shutdown``, a failed call, or its parent's death (checked every ``POLL_MS`` while idle).
"""

import argparse
import logging
import os
import sys
import traceback

import msgspec
import torch
import zmq

from services.worker.engine.config import EngineConfig
from services.worker.engine.distributed.parallel_state import StoreSpec
from services.worker.engine.executor.rank import RankCall, RankReply, RankWorker, Shutdown

POLL_MS = 500
logger = logging.getLogger("baton.rank")


def serve(
    config: EngineConfig, rank: int, calls: str, replies: str, store: str, parent: int
) -> int:
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(calls)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(replies)
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(RankCall)

    def reply(seq: int, error: str = "", result: object = None) -> None:
        raw = msgspec.Raw(encoder.encode(result))
        outbox.send(encoder.encode(RankReply(rank, seq, error, raw)))

    code = 0
    try:
        if config.device.device == "cpu":  # the ranks share the worker's cores
            torch.set_num_threads(cpu_threads(config.parallel.tensor_parallel_size))
        worker = RankWorker(config, rank, StoreSpec(store))
    except Exception as e:
        logger.exception("rank %d failed to start", rank)
        reply(0, f"rank {rank} failed to start: {type(e).__name__}: {e}")
        ctx.destroy(linger=2000)
        return 1
    reply(0)
    seq = 0
    try:
        while True:
            if not inbox.poll(POLL_MS):
                if os.getppid() != parent:
                    logger.warning("rank %d: parent %d is gone; exiting", rank, parent)
                    code = 1
                    break
                continue
            seq += 1
            call = decoder.decode(inbox.recv())
            if isinstance(call, Shutdown):
                break
            answer = worker.handle(call)
            if answer is not None:
                reply(seq, result=answer)
    except Exception as e:
        logger.error("rank %d failed: %s", rank, traceback.format_exc())
        reply(seq, f"rank {rank} failed: {type(e).__name__}: {e}")
        code = 1
    finally:
        worker.close()
        ctx.destroy(linger=2000)
    return code


def cpu_threads(world_size: int) -> int:
    """A rank's share of the worker's threads (OMP_NUM_THREADS, else the CPUs it may run on)."""
    total = int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0)))
    return max(1, total // world_size)


def main() -> None:
    parser = argparse.ArgumentParser(description="Baton tensor-parallel rank")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--calls", required=True)
    parser.add_argument("--replies", required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=EngineConfig)
    sys.exit(serve(config, args.rank, args.calls, args.replies, args.store, args.parent_pid))


if __name__ == "__main__":
    main()
