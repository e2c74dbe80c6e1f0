"""What the two halves of a disaggregated request exchange (docs/internals/kv_transfer.md).

    prefill engine  ──EngineCoreOutput.kv_handle (RemoteKV)──▶ gateway ──▶ decode engine
                                                    EngineCoreRequest.kv_transfer (KVTransferParams)

All msgspec structs: they cross ZMQ (engine ↔ worker front) as msgpack.
"""

import msgspec


class RemoteKV(msgspec.Struct, frozen=True):
    """Where a prompt's KV cache waits: the prefill engine's NIXL agent and its blocks."""

    engine_id: str  # the NIXL agent name
    # tcp://host:port of its handshake socket; a tensor-parallel engine's is one per rank,
    # joined by commas in rank order (each rank has its own agent and blocks)
    side_channel: str
    block_ids: list[int]  # the prompt's blocks, in order
    num_tokens: int  # tokens whose KV those blocks hold (the prompt)
    lease_expires_at: float = 0.0  # wall clock (time.time()) when the blocks are released
    request_id: str = ""  # the prefill engine's id for the leased request (to release it)


class KVTransferParams(msgspec.Struct, frozen=True, omit_defaults=True):
    do_remote_decode: bool = False  # prefill leg: keep the blocks under a lease when finished
    remote: RemoteKV | None = None  # decode leg: pull these blocks instead of prefilling
    first_token_id: int | None = None  # decode leg: the token the prefill leg sampled
    # decode leg: why its worker will not read from that peer (not a prefill worker the
    # scheduler registered): the pull fails at once, unread (recompute, or an error)
    refused: str | None = None


class KVLoad(msgspec.Struct, frozen=True):
    """Scheduler → worker: fill ``local_block_ids`` with ``remote.block_ids`` (same length)."""

    req_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote: RemoteKV
