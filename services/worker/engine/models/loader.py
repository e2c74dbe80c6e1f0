"""Weight loading: Hugging Face safetensors (single file or sharded with an index), GGUF
(llama.cpp's file, dequantized as it loads), or random "dummy" weights of the right shapes for
benchmarks.

Each checkpoint tensor reaches its layer's ``weight_loader`` as a lazy ``CheckpointTensor``
(models/weights.py): a tensor-parallel rank narrows it to its own slice, and only that slice is
read from the file.
"""

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from services.worker.engine.models.weights import (
    CheckpointTarget,
    CheckpointTensor,
    GGUFSlices,
    ReadCounter,
    copy_weight,
)
from services.worker.engine.quantization.base import is_scale
from services.worker.engine.quantization.registry import checkpoint_name
from shared.gguf_checkpoint import GGUFCheckpoint
from shared.gguf_files import gguf_path

_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    path = Path(model_dir)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def load_safetensors(
    model: nn.Module, model_dir: str | Path, show_progress: bool = True
) -> ReadCounter:
    """Copy every checkpoint tensor into its parameter through the ``weight_loader`` of the
    module that owns it (a plain copy for modules without one); returns what was read.

    Raises if a parameter is left unloaded: a half-loaded model would produce silent garbage.
    """
    counter = ReadCounter()

    def tensors() -> Iterator[tuple[str, CheckpointTensor, str]]:
        files = checkpoint_files(model_dir)
        for file in tqdm(files, desc="Loading weights", disable=not show_progress):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    yield name, CheckpointTensor.of(f.get_slice(name), counter), name

    _load(model, tensors(), model_dir)
    return counter


def load_gguf(model: nn.Module, model_path: str | Path, show_progress: bool = True) -> ReadCounter:
    """The same from a GGUF file (or the directory holding one): each tensor, under our name
    (``shared/gguf_checkpoint.py``), is dequantized as it is loaded, only the region a layer
    reads of it (its rank's rows, and the blocks of its columns), then copied into the
    parameter in the model's dtype: one tensor in float32 at a time, the file memory-mapped.
    What was read counts the float32 values made."""
    path = gguf_path(model_path)
    if path is None:
        raise FileNotFoundError(f"no GGUF file at {model_path}")
    checkpoint = GGUFCheckpoint(path)
    counter = ReadCounter()
    tensors = (
        (t.name, CheckpointTensor.of(GGUFSlices(t), counter), t.gguf_name)
        for t in tqdm(checkpoint.tensors, desc="Loading weights", disable=not show_progress)
    )
    _load(model, tensors, path)
    return counter


class _Names:
    """A checkpoint tensor's name → (our parameter's name, the shard it fills), as ``model``
    maps it: through its ``checkpoint_target(name)`` when it has one and answers
    (``CheckpointTarget``: one expert's projection, a family's own spelling), else through its
    ``packed_modules`` table (q/k/v into qkv_proj, gate/up into gate_up_proj); None for a
    tensor the model does not load."""

    def __init__(self, model: nn.Module):
        self.packed: dict[str, tuple[str, str | int]] = getattr(model, "packed_modules", {})
        self.hook: Callable[[str], CheckpointTarget | None] | None = getattr(
            model, "checkpoint_target", None
        )
        self.tied = bool(getattr(getattr(model, "arch", None), "tie_word_embeddings", False))
        # what a model does not run (DeepSeek-V3's multi-token-prediction layers)
        self.unused: Callable[[str], bool] = getattr(
            model, "unused_checkpoint_tensor", lambda _: False
        )
        # checkpoint name prefixes that are others of ours (a multimodal checkpoint's decoder)
        self.renames: dict[str, str] = getattr(model, "checkpoint_prefixes", {})

    def target(self, name: str) -> CheckpointTarget | None:
        for theirs, ours in self.renames.items():
            if name.startswith(theirs):
                name = ours + name.removeprefix(theirs)
                break
        if name.endswith(_SKIPPED_SUFFIXES) or (self.tied and name == "lm_head.weight"):
            return None
        if self.unused(name):
            return None
        ours = checkpoint_name(name)
        found = self.hook(ours) if self.hook is not None else None
        return found if found is not None else CheckpointTarget(*_map_name(ours, self.packed))


# safetensors' names of the floating-point dtypes a float layer's weight has
_FLOAT_DTYPES = frozenset({"BF16", "F16", "F32", "F64"})
# the parameters that hold a layer's weight (a linear layer's, the experts')
_WEIGHTS = frozenset({"weight", "w13_weight", "w2_weight"})


def keep_float(model: nn.Module, model_dir: str | Path) -> list[str]:
    """Give each layer that a quantized checkpoint keeps in floating point its method's float
    counterpart (``LinearMethod.float_method``), before any weight is loaded; returns their
    names. A checkpoint's ignore list (compressed-tensors' ``ignore``, the fp8 method's
    ``modules_to_not_convert``) says which those are in names and patterns of its own; the
    tensors say it exactly: a layer whose every weight the file stores as a float tensor where
    its method expects FP8. Reads only the files' headers. Refuses a layer whose parts differ
    (q float and k in FP8, say): Baton computes them in one product. (Dummy weights have no
    files: every layer keeps the model's method.)"""
    # the layers whose method has a float counterpart (none in a float model: nothing to read)
    swappable = {n: m for n, m in model.named_modules()
                 if getattr(m, "method", None) is not None and m.method.float_method()}  # fmt: skip
    if not swappable:
        return []
    names = _Names(model)
    parts: dict[str, dict[str, bool]] = {}  # our layer → {its checkpoint weights: float}
    for file in checkpoint_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                found = names.target(name)
                if found is None:
                    continue
                layer, _, param = found.param.rpartition(".")
                if param in _WEIGHTS and layer in swappable:
                    dtype = f.get_slice(name).get_dtype()
                    parts.setdefault(layer, {})[name] = dtype in _FLOAT_DTYPES
    kept = []
    for layer, weights in parts.items():
        floats = sorted(n for n, is_float in weights.items() if is_float)
        if not floats:
            continue
        if len(floats) != len(weights):
            others = sorted(set(weights) - set(floats))
            raise ValueError(
                f"the checkpoint keeps {floats[0]} float but {others[0]} quantized: Baton "
                f"computes both in one layer ({layer}), in one format"
            )
        module = swappable[layer]
        module.set_method(module.method.float_method())
        kept.append(layer)
    return kept


def _load(
    model: nn.Module, tensors: Iterable[tuple[str, CheckpointTensor, str]], source: str | Path
) -> None:
    """Load (our name, tensor, the checkpoint's name for it) triples (``_Names`` maps them);
    refuses a tensor without a parameter, and a checkpoint that leaves a parameter (or an
    expert's weight) unloaded."""
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    names = _Names(model)
    loaded: set[str] = set()
    for name, tensor, label in tensors:
        found = names.target(name)
        if found is None:
            continue
        target, shard = found
        if target not in params:
            raise ValueError(f"checkpoint tensor {label!r} has no matching parameter")
        param = params[target]
        owner = modules[target.rpartition(".")[0]]
        loader = getattr(owner, "weight_loader", None)
        try:
            if loader is not None:
                loader(param, tensor, shard)
            else:
                copy_weight(param, tensor)
        except ValueError as e:  # name the tensor: a wrong layout must be findable
            raise ValueError(f"checkpoint tensor {label!r}: {e}") from None
        loaded.add(target)
    if names.tied:
        loaded.add("lm_head.weight")
    for prefix, module in modules.items():  # what a layer computes at load, not reads
        derived = getattr(module, "derived_parameters", None)
        for name in derived() if derived is not None else ():
            loaded.add(f"{prefix}.{name}")
    missing = sorted(set(params) - loaded)
    for prefix, module in modules.items():  # parts of a parameter (one expert's weights)
        unloaded = getattr(module, "unloaded_weights", None)
        missing += [f"{prefix}.{name}" for name in (unloaded() if unloaded is not None else ())]
    if missing:
        raise ValueError(f"checkpoint {source} lacks weights for: {', '.join(missing[:8])}")


def _map_name(name: str, packed: dict[str, tuple[str, str | int]]) -> tuple[str, str | int | None]:
    for ckpt, (ours, shard) in packed.items():
        if f".{ckpt}." in name:
            return name.replace(f".{ckpt}.", f".{ours}."), shard
    return name, None


def load_dummy(model: nn.Module, seed: int) -> None:
    """Small uniform random weights (norm weights near 1, scales 1), reproducible from
    ``seed``."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.rand(param.shape, generator=gen, dtype=torch.float32, device=device)
        if is_scale(param):
            values = torch.ones_like(noise)
        elif name.endswith("norm.weight"):
            values = 1.0 + (noise - 0.5) * 0.1
        else:
            values = (noise - 0.5) * 0.04
        param.data.copy_(values.to(param.dtype))
