"""What the two halves of a disaggregated request exchange (docs/internals/kv_transfer.md).

    prefill engine  ──EngineCoreOutput.kv_handle (RemoteKV)──▶ gateway ──▶ decode engine
                                                    EngineCoreRequest.kv_transfer (KVTransferParams)

All msgspec structs: they cross ZMQ (engine ↔ worker front) as msgpack.
"""

import msgspec

NO_BLOCK = 0xFFFFFFFF  # in a handle: a block not sent (a uint32 on the gRPC wire)
MAX_KV_GROUPS = 64  # bound at the edge: a handle names at most this many groups


class RemoteKV(msgspec.Struct, frozen=True):
    """Where a prompt's KV cache waits: the prefill engine's NIXL agent and its blocks."""

    engine_id: str  # the NIXL agent name
    # tcp://host:port of its handshake socket; a tensor-parallel engine's is one per rank,
    # joined by commas in rank order (each rank has its own agent and blocks)
    side_channel: str
    # the prompt's blocks: one run of ceil(num_tokens / block_size) per KV cache group, in
    # group order; NO_BLOCK where the decode side needs none (a windowed group's blocks
    # before the prompt's last window)
    block_ids: list[int]
    num_tokens: int  # tokens whose KV those blocks hold (the prompt)
    lease_expires_at: float = 0.0  # wall clock (time.time()) when the blocks are released
    request_id: str = ""  # the prefill engine's id for the leased request (to release it)
    num_groups: int = 1  # KV cache groups (kv_cache/groups.py)

    def group_block_ids(self) -> list[list[int]]:
        """``block_ids`` cut into its groups' runs."""
        per = len(self.block_ids) // max(1, self.num_groups)
        return [self.block_ids[g * per : (g + 1) * per] for g in range(self.num_groups)]


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
