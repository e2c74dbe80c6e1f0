"""Checkpoint tensors read lazily: a tensor-parallel rank reads only its slice of each weight.

``CheckpointTensor`` wraps one tensor of an open safetensors file (safetensors' ``get_slice``)
or GGUF file (``GGUFSlices``). Narrowing it costs nothing; ``load()`` reads only the narrowed
region from the file (a GGUF file's: dequantized), so a rank of a column- or row-parallel layer
never holds the whole matrix, and a worker never materialises the whole model in one process.
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

if TYPE_CHECKING:
    from shared.gguf_checkpoint import GGUFTensor


@dataclass
class ReadCounter:
    """What the loads of one model read from its checkpoint."""

    bytes: int = 0
    tensors: int = 0


@dataclass
class CheckpointTensor:
    handle: Any  # safetensors' PySafeSlice of this tensor
    shape: tuple[int, ...]
    counter: ReadCounter
    region: tuple[slice, ...] = field(default=())  # one slice per dimension; () = all of it
    # the handle's first dimension is one entry of it (``entry``), not shown in ``shape``
    entry_of: bool = False

    @classmethod
    def of(cls, handle: Any, counter: ReadCounter) -> "CheckpointTensor":
        shape = tuple(int(d) for d in handle.get_shape())
        return cls(handle, shape, counter, tuple(slice(0, d) for d in shape))

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> "CheckpointTensor":
        dim = dim % len(self.shape)
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise ValueError(
                f"slice [{start}, {start + length}) of dimension {dim} is outside {self.shape}"
            )
        at = dim + int(self.entry_of)  # (the region's dimension)
        base = self.region[at].start
        region = list(self.region)
        region[at] = slice(base + start, base + start + length)
        shape = list(self.shape)
        shape[dim] = length
        return CheckpointTensor(self.handle, tuple(shape), self.counter, tuple(region),
                                self.entry_of)  # fmt: skip

    def entry(self, index: int) -> "CheckpointTensor":
        """Entry ``index`` of the first dimension (one expert of a stacked tensor), as lazy:
        its narrowing reads only what is narrowed to."""
        if self.entry_of or not self.shape:
            raise ValueError("an entry of an entry (or of a scalar) is not supported")
        one = self.narrow(0, index, 1)
        return CheckpointTensor(self.handle, one.shape[1:], self.counter, one.region, True)

    def load(self) -> torch.Tensor:
        if not self.region:  # a scalar (safetensors cannot slice it), or one made without one
            t = self.handle[()] if not self.shape else self.handle[:]
        else:
            t = self.handle[self.region]
        if self.entry_of:
            t = t[0]
        self.counter.bytes += t.numel() * t.element_size()
        self.counter.tensors += 1
        return t


class GGUFSlices:
    """A GGUF tensor as ``CheckpointTensor`` reads its handle: a shape, and any region of it
    dequantized to float32 (``GGUFTensor.read``: only the rows asked for, and the blocks of
    the columns)."""

    def __init__(self, tensor: "GGUFTensor"):
        self.tensor = tensor

    def get_shape(self) -> tuple[int, ...]:
        return self.tensor.shape

    def __getitem__(self, region: tuple[slice, ...]) -> torch.Tensor:
        return torch.from_numpy(self.tensor.read(region))


Loaded = torch.Tensor | CheckpointTensor


class CheckpointTarget(NamedTuple):
    """Where a checkpoint tensor loads, as a model's ``checkpoint_target(name)`` answers for
    the names its packed-module table cannot map (models/loader.py): one expert's projection
    of a mixture-of-experts layer, a name another model family spells differently."""

    param: str  # our parameter's full name
    shard: object  # what the owning module's ``weight_loader`` takes as its shard id


def full(t: Loaded) -> torch.Tensor:
    """The whole of a (lazy) checkpoint tensor, read."""
    return t.load() if isinstance(t, CheckpointTensor) else t


def entry(t: Loaded, index: int) -> Loaded:
    """Entry ``index`` of a (lazy) checkpoint tensor's first dimension: one expert of a stacked
    tensor, still lazy where the tensor is."""
    return t.entry(index) if isinstance(t, CheckpointTensor) else t[index]


def one_value(t: Loaded, what: str) -> torch.Tensor:
    """A per-tensor scale as float32 of shape [1]; refuses one of more values."""
    value = full(t).float().reshape(-1)
    if value.numel() != 1:
        raise ValueError(f"{what} has one value, got shape {tuple(t.shape)}")
    return value


def vector_length(t: Loaded) -> int | None:
    """n for a tensor that is one vector of n values, however it is shaped ([n], [n, 1],
    [1, n]: a per-channel scale as checkpoints store it); None for any other shape."""
    shape = [int(n) for n in t.shape]
    longer = [n for n in shape if n != 1]
    return (longer[0] if longer else 1) if len(longer) <= 1 else None


def vector_part(t: Loaded, start: int, length: int) -> torch.Tensor:
    """Values [start, start + length) of such a vector (``vector_length``) as float32 [length],
    only they read."""
    axis = next((d for d, n in enumerate(t.shape) if n != 1), 0)
    return full(t.narrow(axis, start, length) if t.dim() else t).float().reshape(-1)


def copy_weight(dst: torch.Tensor, src: Loaded) -> None:
    """Copy a checkpoint tensor into a parameter (or a slice of one), refusing a shape mismatch."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"checkpoint tensor of shape {tuple(src.shape)} != {tuple(dst.shape)}")
    dst.data.copy_(full(src))
