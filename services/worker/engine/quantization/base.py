"""The seams between a layer and its quantization: a method object per layer kind.

A ``LinearMethod`` owns everything about how a linear layer keeps and multiplies its weight:
``create_weights`` registers the layer's parameters (at least ``weight``, [out, in] of this
rank), ``load`` takes the checkpoint tensors it owns (scales; a float weight it quantizes at
load), ``process_weights_after_loading`` derives what its kernels want from the loaded values,
``apply`` multiplies, and ``input_group`` says whether the product takes its input already
quantized (``fp8_math.Codes``), so that the kernel before the layer can write it that way.
The layer (``models/layers/linear.py``) keeps only tensor-parallel sharding: which rows and
columns of a checkpoint tensor are this rank's (``Shard``, ``rank_slice``).

A ``MoEMethod`` does the same for a mixture-of-experts layer's experts (``Experts``: every
expert's gate and up projections stacked in ``w13_weight`` [E, 2I, H], the down projections in
``w2_weight`` [E, H, I]); its implementations are in ``moe.py``.

A ``KVCacheMethod`` does the same for an attention layer's KV cache scales.

One method object serves every layer of its kind in a model: what differs between layers
(shapes, scales) is on the layer.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import nn

from services.worker.engine.models.weights import Loaded
from services.worker.engine.quantization.fp8_math import Codes


@dataclass(frozen=True, slots=True)
class Shard:
    """Where a checkpoint tensor's rows go on this rank: the parameter's rows
    [dst, dst + size) take the checkpoint rows [src, src + size) of a tensor of ``total``."""

    dst: int
    size: int
    src: int
    total: int


class Linear(Protocol):
    """What a method sees of a tensor-parallel linear layer (``models/layers/linear.py``)."""

    in_features: int  # this rank's input columns
    out_features: int  # this rank's output rows
    in_total: int  # the checkpoint's input columns (row-parallel: every rank's)
    col_start: int  # this rank's first input column in the checkpoint

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None: ...

    def register_buffer(
        self, name: str, tensor: torch.Tensor | None, persistent: bool = True
    ) -> None: ...

    def rank_slice(self, loaded: Loaded, shard: Shard) -> Loaded: ...


def scale_parameter(*shape: int, fill: float = 0.0) -> nn.Parameter:
    """A float32 scale parameter, marked so that random ("dummy") weights give it 1.0."""
    param = nn.Parameter(torch.full(shape, fill, dtype=torch.float32), requires_grad=False)
    param.is_scale = True  # type: ignore[attr-defined]
    return param


def is_scale(param: torch.Tensor) -> bool:
    """A parameter made by ``scale_parameter``."""
    return bool(getattr(param, "is_scale", False))


def tensor(layer: object, name: str) -> torch.Tensor:
    """A tensor a method registered on its layer."""
    value = getattr(layer, name)
    assert isinstance(value, torch.Tensor), f"{name} is not a tensor of {type(layer).__name__}"
    return value


def optional_tensor(layer: object, name: str) -> torch.Tensor | None:
    """A tensor a method may have registered on its layer, or None."""
    value = getattr(layer, name, None)
    return value if isinstance(value, torch.Tensor) else None


class LinearMethod(ABC):
    """How a linear layer keeps and multiplies its weight."""

    # what a worker reports its linear layers are ("" in the model's dtype)
    description: str = ""
    # parameters computed at load rather than read from the checkpoint
    derived_parameters: tuple[str, ...] = ()

    @abstractmethod
    def create_weights(self, layer: Linear) -> None:
        """Register ``weight`` [out_features, in_features] and whatever the product needs."""

    def load(self, layer: Linear, param: nn.Parameter, loaded: Loaded, shard: Shard) -> bool:
        """Load a checkpoint tensor this method owns into ``param``; False leaves it to the
        layer, which copies this rank's slice as it is."""
        return False

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Derive what the kernels want from the loaded values (once, on the device)."""
        return None

    def input_group(self, layer: Linear, like: torch.Tensor) -> int:
        """Whether the product takes an input like ``like`` as codes (``Codes``) and in groups
        of how many columns (its width: per token); 0 for the input itself. Asked once per
        layer, with the weights on their device."""
        return 0

    def float_method(self) -> "LinearMethod | None":
        """The method for a layer that the checkpoint keeps in floating point where this
        method expects its own format (a quantized checkpoint's ignore list); None where a
        float weight is what this method takes (the model's dtype, or quantized at load)."""
        return None

    @abstractmethod
    def apply(
        self, layer: Linear, x: torch.Tensor | Codes, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x Wᵀ (+ bias)`` for this rank, in x's dtype."""


# an expert's projections: ``w13`` holds gate (its first half of rows) and up, ``w2`` down
Proj = Literal["gate", "up", "down"]


class Experts(Protocol):
    """What a method sees of a fused mixture-of-experts layer (``models/layers/moe.py``)."""

    num_experts: int  # this rank's experts (w13/w2's first dimension)
    hidden_size: int
    intermediate_size: int  # this rank's share of one expert's intermediate dimension
    intermediate_total: int  # one expert's in the checkpoint
    intermediate_start: int  # where this rank's share starts in it (0 with EP)
    # int32 [every expert]: a checkpoint expert's index in w13/w2, -1 where another rank has
    # it (expert parallelism); None: this rank has every expert
    expert_map: torch.Tensor | None
    # the experts' biases (gpt-oss), in the model's dtype: w13_bias [E, 2I] added to the gate
    # and up products, w2_bias [E, H] to the down product; None: none
    w13_bias: torch.Tensor | None
    w2_bias: torch.Tensor | None
    # what ``activate`` computes: "silu" is silu(gate) · up; "swiglu_clamped" gpt-oss's
    # (up + 1) · gate · σ(alpha · gate) with gate ≤ limit and |up| ≤ limit (ops/fused_moe
    # fuses both)
    activation: str
    alpha: float
    limit: float

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None: ...

    def rank_slice(self, loaded: Loaded, proj: Proj) -> Loaded: ...

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] (gate ‖ up, this rank's) → [T, I], in gate_up's dtype."""
        ...


def expert_part(param: torch.Tensor, expert: int, proj: Proj) -> torch.Tensor:
    """One expert's ``proj`` in a w13- or w2-shaped tensor (weights or scales): gate the first
    half of w13's rows, up the second half, down the whole of w2's."""
    rows = param.data[expert]
    if proj == "down":
        return rows
    half = rows.shape[0] // 2
    return rows[:half] if proj == "gate" else rows[half:]


class MoEMethod(ABC):
    """How a mixture-of-experts layer keeps its experts' weights and runs them."""

    description: str = ""
    derived_parameters: tuple[str, ...] = ()  # computed at load, not read

    @abstractmethod
    def create_weights(self, layer: Experts) -> None:
        """Register ``w13_weight`` [E, 2I, H], ``w2_weight`` [E, H, I] (this rank's E and I)
        and whatever ``apply`` needs."""

    def load(
        self, layer: Experts, param: nn.Parameter, loaded: Loaded, expert: int, proj: Proj
    ) -> bool:
        """Load one checkpoint expert's tensor (``expert``: its index on this rank) that this
        method owns into ``param``; False leaves it to the layer, which copies this rank's
        slice into ``expert_part(param, expert, proj)`` as it is."""
        return False

    def process_weights_after_loading(self, layer: Experts) -> None:
        """Derive what the kernels want from the loaded values (once, on the device)."""
        return None

    def float_method(self) -> "MoEMethod | None":
        """As ``LinearMethod.float_method``, for experts the checkpoint keeps float."""
        return None

    @abstractmethod
    def apply(
        self, layer: Experts, x: torch.Tensor, topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """``Σ_j topk_weights[t, j] · expert_{topk_ids[t, j]}(x[t])`` over this rank's experts
        (ids are the checkpoint's; the others' contribute nothing), [T, H] in x's dtype, not
        yet summed over ranks. ``expert(x) = down(activate(gate x ‖ up x))``, each product
        with its bias where the layer has them."""


class KVCacheMethod:
    """An attention layer's KV cache scales: none (1.0) unless a method says otherwise."""

    def create_weights(self, layer: nn.Module) -> None:
        """Register the scale parameters the checkpoint holds for this layer (none here)."""

    def load(self, param: nn.Parameter, loaded: Loaded) -> None:
        raise ValueError("this model's attention layers take no KV cache scales")

    def scales(self, layer: nn.Module) -> tuple[float, float]:
        """The (key, value) scales an FP8 cache of this layer takes."""
        return 1.0, 1.0
