"""A step's grammar bitmask, and its application to the logits (the runner's side).

Row ``i`` of ``bits`` belongs to request ``req_ids[i]``: bit ``t`` of it (32 tokens an int32
word, xgrammar's layout) says whether token ``t`` may be sampled. Only the constrained rows
travel; the runner places them at its sample rows and masks only those rows.
"""

from dataclasses import dataclass

import msgspec
import numpy as np
import torch


@dataclass
class GrammarBitmask:
    req_ids: list[str]
    bits: torch.Tensor  # int32 [len(req_ids), ceil(vocab / 32)], on the host

    def to_wire(self) -> "BitmaskWire":
        return BitmaskWire(self.req_ids, self.bits.shape[1], self.bits.numpy().tobytes())


class BitmaskWire(msgspec.Struct):
    """A ``GrammarBitmask`` as it travels to a tensor-parallel rank (plain bytes)."""

    req_ids: list[str]
    words: int
    data: bytes

    def to_bitmask(self) -> GrammarBitmask:
        words = np.frombuffer(self.data, dtype=np.int32).reshape(len(self.req_ids), self.words)
        return GrammarBitmask(self.req_ids, torch.from_numpy(words.copy()))


def apply_bitmask(
    logits: torch.Tensor, grammar: GrammarBitmask, rows: list[int], vocab_size: int
) -> None:
    """Mask, in place, every token the grammar forbids in the given logits rows (``rows[i]``
    takes ``grammar.bits[i]``); other rows are left alone. One kernel over those rows:
    xgrammar's (Triton on a GPU, a CPU loop on the host)."""
    import xgrammar as xgr  # (only a step with a constrained row gets here)

    bits = grammar.bits.to(logits.device, non_blocking=True)
    if rows == list(range(logits.shape[0])):  # every row, in order (a fully constrained batch)
        xgr.apply_token_bitmask_inplace(logits, bits, vocab_size=vocab_size)
        return
    full = torch.full((logits.shape[0], bits.shape[1]), -1, dtype=torch.int32, device=logits.device)
    index = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
    full.index_copy_(0, index, bits)
    xgr.apply_token_bitmask_inplace(logits, full, vocab_size=vocab_size, indices=rows)
