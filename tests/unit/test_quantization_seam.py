"""Quantization is a method of a layer (services/worker/engine/quantization/), not a branch in
every layer: nothing outside the quantization package and the kernels it calls branches on a
model's quantization, and a new method plugs into the registry without touching a model file."""

import ast
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.worker.engine.quantization import registry
from services.worker.engine.quantization.base import Linear, LinearMethod, Shard, tensor
from services.worker.engine.quantization.config import QuantConfig

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ROOT / "services"
# the package that owns quantization, and the kernels its methods call
OWNERS = (SERVICES / "worker/engine/quantization", SERVICES / "worker/engine/ops")
# the KV cache's element type (EngineArgs.kv_cache_dtype: "fp8" stores keys and values in
# e4m3) is the cache's, not a layer's quantization method: conditions about it are allowed
KV_CACHE_DTYPE = ("kv_cache_dtype", "is_fp8", "fp8_kv")


def _branches(path: Path, root: Path = ROOT) -> list[str]:
    """The conditions in a file that name quantization or FP8: of if / elif / while / a
    conditional expression / an assert / a match, and every isinstance() call."""
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        test: ast.AST | None = None
        if isinstance(node, ast.If | ast.IfExp | ast.While | ast.Assert):
            test = node.test
        elif isinstance(node, ast.Match):
            test = node.subject
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
            test = node
        if test is None:
            continue
        text = ast.get_source_segment(source, test) or ""
        if any(name in text for name in KV_CACHE_DTYPE):
            continue
        if "quant" in text.lower() or "fp8" in text.lower():
            found.append(f"{path.relative_to(root)}:{node.lineno}: {text}")
    return found


def _outside_owners() -> list[Path]:
    return [
        p for p in sorted(SERVICES.rglob("*.py"))
        if not any(p.is_relative_to(owner) for owner in OWNERS)
    ]  # fmt: skip


def test_no_code_outside_the_quantization_package_branches_on_quantization() -> None:
    files = _outside_owners()
    assert len(files) > 50  # (the walk found the tree)
    branches = [b for path in files for b in _branches(path)]
    assert not branches, "quantization decided outside quantization/:\n" + "\n".join(branches)


def test_the_check_finds_a_branch_on_quantization(tmp_path: Path) -> None:
    """The check above is not vacuous: the branches the layers had before are found."""
    sample = tmp_path / "layer.py"
    sample.write_text(
        "def f(self, quant, x, kv):\n"
        "    if quant is not None and quant.weights == 'block':\n"
        "        return 1\n"
        "    y = 2 if self.quant else 3\n"
        "    assert isinstance(x, Fp8LinearMethod)\n"
        "    if kv.is_fp8:\n"  # (the KV cache's dtype: allowed)
        "        return 4\n"
    )
    found = sorted(set(_branches(sample, tmp_path)), key=lambda b: int(b.split(":")[1]))
    assert [line.split(":")[1] for line in found] == ["2", "4", "5"]  # (by line)


def test_model_files_import_no_quantization_method() -> None:
    """Models and layers know the seams (base, registry, config, and ``Codes``, the activation
    the norms hand an FP8 layer), never a method: adding one touches no model file."""
    allowed = {"base", "config", "fp8_math", "registry"}
    seen = set()
    for path in sorted((SERVICES / "worker/engine/models").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                if parts[:4] == ["services", "worker", "engine", "quantization"]:
                    module = parts[4] if len(parts) > 4 else node.names[0].name
                    seen.add(module)
                    assert module in allowed, f"{path.relative_to(ROOT)} imports {node.module}"
    assert {"base", "registry"} <= seen  # (the walk saw the seams)


class TransposedLinearMethod(LinearMethod):
    """A method the registry does not know: the weight kept transposed ([in, out]) after
    loading, multiplied as ``x @ Wt``. It loads through the layer's sharding like any other."""

    description = "transposed (test)"

    def create_weights(self, layer: Linear) -> None:
        weight = torch.empty(layer.out_features, layer.in_features)
        layer.register_parameter("weight", nn.Parameter(weight, requires_grad=False))

    def load(self, layer: Linear, param: nn.Parameter, loaded: Any, shard: Shard) -> bool:
        return False  # the layer copies its slice

    def process_weights_after_loading(self, layer: Linear) -> None:
        layer.register_buffer("weight_t", tensor(layer, "weight").t().contiguous())

    def apply(self, layer: Linear, x: Any, bias: torch.Tensor | None) -> torch.Tensor:
        y = x @ tensor(layer, "weight_t")
        return y if bias is None else y + bias


def test_a_new_method_plugs_into_every_linear_layer_of_a_model(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.worker.engine.attention.torch_ref import TorchAttentionBackend
    from services.worker.engine.model_config import load_arch_config
    from services.worker.engine.models.context import ModelContext
    from services.worker.engine.models.layers.linear import LinearBase
    from services.worker.engine.models.registry import resolve_model_class

    monkeypatch.setitem(
        registry.LINEAR_METHODS, "transposed", lambda quant, kernels: TransposedLinearMethod()
    )
    arch = load_arch_config(tiny_model)
    quant = QuantConfig("transposed", "token", method="transposed (test)")
    ctx = ModelContext.build(64, TorchAttentionBackend, kernels=False, quant=quant)
    model = resolve_model_class(arch.architecture)(arch, ctx)
    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert len(layers) == 4 * arch.num_layers  # qkv, o, gate_up, down
    assert all(isinstance(m.method, TransposedLinearMethod) for m in layers)
    down = model.model.layers[0].mlp.down_proj
    down.weight_loader(down.weight, torch.randn(down.out_features, down.in_features))
    down.after_load()
    x = torch.randn(3, down.in_features)
    assert torch.allclose(down(x), F.linear(x, down.weight), atol=1e-5)
