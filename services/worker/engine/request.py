"""The engine-side request: its tokens, how many of them have KV computed, and its status.

There are no prefill/decode phases: the scheduler only drives ``num_computed_tokens`` to catch up
with ``num_tokens``. A prompt of 40 with 3 outputs and 42 computed has one token to run.
"""

import enum
from typing import TYPE_CHECKING

from services.worker.engine.kv_transfer.params import MAX_KV_GROUPS, KVTransferParams
from services.worker.engine.params import SamplingParams
from shared.block_hash import ROOT_HASH, hash_blocks
from shared.ids import BlockHash, RequestId

if TYPE_CHECKING:  # (the front ends import this module, torch-free; the grammar's is not)
    from services.worker.engine.structured.manager import RequestGrammar


class RequestStatus(enum.IntEnum):
    """Ordered: every status from FINISHED_STOPPED on is final."""

    WAITING = 1
    WAITING_FOR_REMOTE_KV = 2  # decode leg: its prompt's KV is being pulled from a prefill engine
    RUNNING = 3
    PREEMPTED = 4
    FINISHED_STOPPED = 5
    FINISHED_LENGTH_CAPPED = 6
    FINISHED_ABORTED = 7
    FINISHED_ERROR = 8  # e.g. its KV pull failed

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class FinishReason(enum.StrEnum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # the client went away or asked
    ERROR = "error"  # the engine could not run it (the error text travels with it)


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    def __init__(
        self,
        request_id: RequestId,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: tuple[int, ...],
        block_size: int,
        max_model_len: int,
        cache_salt: str | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens sampled by steps still in flight (async scheduling): their ids are not known
        # here yet, but the next step already computes them (the runner feeds them on device).
        self.num_output_placeholders = 0
        self.num_cached_tokens: int | None = None  # prefix-cache hit at first scheduling
        self.num_preemptions = 0
        self.admitted_at = 0.0  # time.monotonic() when the scheduler took it
        self.kv_transfer: KVTransferParams | None = None  # a disaggregated request's leg
        self.kv_ready = False  # decode leg: the pulled KV is in place
        self.queued_seconds = 0.0  # admitted → first scheduled
        self.stop_reason: int | None = None  # the stop token id that ended it, if any
        limit = max_model_len - len(prompt_token_ids)
        self.max_tokens = min(params.max_tokens if params.max_tokens is not None else limit, limit)
        # prompt positions whose logprobs went out (prompt_logprobs): a chunk recomputed after a
        # preemption is not reported twice
        self.num_prompt_logprobs = 0
        # its grammar (structured outputs): compiled elsewhere; the request waits for it
        self.grammar: RequestGrammar | None = None
        self.error: str | None = None  # why it ended with an error in a step
        self._block_size = block_size
        self._extra_keys = (cache_salt,) if cache_salt else ()
        self.block_hashes: list[BlockHash] = hash_blocks(
            self.all_token_ids, block_size, self._extra_keys
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def length_reached(self) -> bool:
        """Its last token is already sampled, if not yet known: nothing more to schedule. (A
        request with ``max_tokens=0`` runs its whole prompt, then ends.)"""
        sampled = len(self.output_token_ids) + self.num_output_placeholders
        return sampled >= max(self.max_tokens, 1)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.num_tokens % self._block_size == 0:  # a block just filled up: extend the chain
            self.block_hashes += hash_blocks(
                self.all_token_ids,
                self._block_size,
                self._extra_keys,
                start=len(self.block_hashes),
                parent=self.block_hashes[-1] if self.block_hashes else ROOT_HASH,
            )

    def attach_kv_transfer(self, params: KVTransferParams) -> None:
        """Make this request a leg of a disaggregated one. A decode leg (``params.remote``)
        arrives with the prefill leg's first token as its first output and waits for its
        prompt's KV (``WAITING_FOR_REMOTE_KV``); raises ValueError for a handle that does not
        fit the prompt."""
        self.kv_transfer = params
        remote = params.remote
        if remote is None:
            return
        if params.first_token_id is None:
            raise ValueError("a decode leg needs the prefill leg's first token")
        if remote.num_tokens != self.num_prompt_tokens:
            raise ValueError(
                f"the KV handle covers {remote.num_tokens} tokens, the prompt has "
                f"{self.num_prompt_tokens}"
            )
        if not 1 <= remote.num_groups <= MAX_KV_GROUPS:
            raise ValueError(f"the KV handle names {remote.num_groups} KV cache groups")
        blocks = -(-self.num_prompt_tokens // self._block_size)
        if len(remote.block_ids) != blocks * remote.num_groups:
            raise ValueError("the KV handle's block count does not match the prompt")
        self.append_output_token(params.first_token_id)  # sampled there, not again here
        self.status = RequestStatus.WAITING_FOR_REMOTE_KV

    def check_stop(self) -> RequestStatus | None:
        """After appending a token: the final status it causes, if any. A grammar that has
        ended (its stop token accepted) ends the request, ``ignore_eos`` or not."""
        last = self.output_token_ids[-1]
        if len(self.output_token_ids) >= self.params.min_tokens:
            if not self.params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in self.params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.grammar is not None and self.grammar.terminated:
            return RequestStatus.FINISHED_STOPPED
        if len(self.output_token_ids) >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None
