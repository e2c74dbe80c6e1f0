"""FP8 tiny checkpoints (``baton make-tiny-model DIR --quantize ...``), and the plain-PyTorch
reference that dequantizes them: the oracle the engine's FP8 layers are tested against.

    fp8-tensor   compressed-tensors float-quantized: one scale per weight, static per-tensor
                 activation scales calibrated on a text
    fp8-channel  compressed-tensors float-quantized: a scale per output channel, activations
                 dynamic per token
    fp8-block    the ``fp8`` method: 128×128 weight blocks (``weight_scale_inv``), activations
                 dynamic per token and 128 columns

``kv_scales`` (compressed-tensors formats): a key and a value scale per layer as well
(``kv_cache_scheme``; ``self_attn.k_scale`` / ``v_scale``), calibrated on the same text as
the largest key and value entering each layer's cache over 448, so that an FP8 KV cache spans
e4m3's range instead of its subnormals.

The float model's weights get a heavier tail first (a few output channels ×6): with uniform
weights every scale layout would quantize alike, and a wrong layout would pass unnoticed. That
float model is kept beside it, in ``DIR/unquantized``, to compare FP8 against.

Mixture-of-experts models (Qwen3-MoE, Mixtral) quantize every expert's projections as their
own tensors (``experts.<e>.gate_proj``, ``w1``, ...: the names real checkpoints have, which
``save_pretrained`` writes too); the router stays float (compressed-tensors lists it in
``ignore``). Their activations are dynamic (fp8-channel, fp8-block).

Gated DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) quantize q ‖ k ‖ v ‖ z and the output
projection; their b and a projections, convolution, routers and shared-expert gates stay float
and are listed by name (``modules_to_not_convert``, or ``ignore``), as the published FP8
checkpoints list them.
"""

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FORMATS = ("fp8-tensor", "fp8-channel", "fp8-block")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           # DeepSeek's latent attention (its FP8 checkpoints quantize them all)
           "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
           # Gated DeltaNet's (Qwen3.5's, Qwen3-Next's spelling): its b and a projections stay
           # float, as in the published checkpoints (``_FLOAT``)
           "in_proj_qkv", "in_proj_z", "in_proj_qkvz", "out_proj")  # fmt: skip
# the checkpoint's quantized tensors: the linear layers', and each expert's (Mixtral's w1 gate,
# w3 up, w2 down)
_QUANTIZED = (*LINEARS, "w1", "w2", "w3")
# one expert's weight in a checkpoint → (layer prefix, expert, projection)
_EXPERT = re.compile(r"^(.+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
BLOCK = 128
# one fused matmul
_SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"),
                 ("in_proj_qkv", "in_proj_z"))  # fmt: skip
# the layers the published checkpoints leave float and list so (``modules_to_not_convert``,
# compressed-tensors' ``ignore``): a router, Qwen3-Next's shared-expert gate, Gated DeltaNet's
# b and a projections and its convolution
_FLOAT = re.compile(r"\.(mlp\.gate|mlp\.shared_expert_gate|linear_attn\.(in_proj_[ab]|"
                    r"in_proj_ba|conv1d))$")  # fmt: skip
# the prompts the engine is checked on against ``dequantized_reference`` (the tests' and
# benchmarks/fp8_accuracy.py's)
PROMPTS = [
    "Hi", "The quick brown fox jumps over the lazy dog", "import os\nimport sys\n\n",
    "Return a new list containing all items from the iterable in ascending order.",
]  # fmt: skip
_CALIBRATION = "The quick brown fox jumps over the lazy dog. import os, sys; return a sorted list."


def _linears(model: Any) -> dict[str, Any]:
    return {n: m for n, m in model.named_modules() if n.rpartition(".")[2] in LINEARS}


def _experts(model: Any) -> dict[str, Any]:
    """A ``transformers`` MoE model's expert modules (each layer's experts as two 3-D
    parameters, ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I])."""
    return {n: m for n, m in model.named_modules() if n.endswith(".experts")}


@contextlib.contextmanager
def _cache_entries(each: Any) -> Iterator[None]:
    """Every key and value entering a ``transformers`` cache goes through ``each(keys, values,
    layer)``, which returns what is stored (and computed with) instead."""
    from transformers.cache_utils import Cache

    update = Cache.update

    def hooked(self: Any, k: Any, v: Any, layer_idx: int, *a: Any, **kw: Any) -> Any:
        k, v = each(k, v, layer_idx)
        return update(self, k, v, layer_idx, *a, **kw)

    Cache.update = hooked  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        Cache.update = update  # type: ignore[method-assign]


def _kv_amax(model: Any, tokenizer: Any) -> dict[int, tuple[float, float]]:
    """Per layer, the largest |key| and |value| entering the cache on the calibration text."""
    import torch

    seen: dict[int, tuple[float, float]] = {}

    def record(k: Any, v: Any, layer: int) -> tuple[Any, Any]:
        old = seen.get(layer, (0.0, 0.0))
        seen[layer] = (max(old[0], float(k.abs().max())), max(old[1], float(v.abs().max())))
        return k, v

    with torch.no_grad(), _cache_entries(record):
        model(**tokenizer(_CALIBRATION, return_tensors="pt"), use_cache=True)
    return seen


def kv_scales(path: str | Path) -> dict[int, tuple[float, float]]:
    """A checkpoint's KV cache scales: {layer: (k_scale, v_scale)} ({} without them)."""
    from safetensors import safe_open

    scales: dict[int, tuple[float, float]] = {}
    with safe_open(str(Path(path) / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            if name.endswith(("self_attn.k_scale", "self_attn.v_scale")):
                layer = int(name.split(".layers.")[1].split(".")[0])
                k, v = scales.get(layer, (1.0, 1.0))
                value = float(f.get_tensor(name).float().reshape(()))
                scales[layer] = (value, v) if name.endswith("k_scale") else (k, value)
    return scales


@contextlib.contextmanager
def rounding_kv_cache(path: str | Path) -> Iterator[None]:
    """While it holds, ``transformers`` models store each key and value rounded through e4m3
    as an FP8 KV cache holds them: ``e4m3(k / k_scale) · k_scale`` with the checkpoint's
    per-layer scales, or 1 without them (the oracle of ``kv_cache_dtype="fp8"``)."""
    import torch

    from services.worker.engine.quantization.fp8_math import to_e4m3

    scales = kv_scales(path)

    def rounded(k: Any, v: Any, layer: int) -> tuple[Any, Any]:
        ks, vs = scales.get(layer, (1.0, 1.0))
        return ((to_e4m3(k, ks).float() * ks).to(k.dtype),
                (to_e4m3(v, vs).float() * vs).to(v.dtype))  # fmt: skip

    with torch.no_grad(), _cache_entries(rounded):
        yield


def kept_float(name: str, entries: tuple[str, ...]) -> bool:
    """Whether an ignore list's ``entries`` name the module ``name``: ``re:`` and a pattern
    matched from the name's start (as compressed-tensors matches them), or a module's name,
    the whole name or whole dotted parts of it."""
    return any(re.match(e[3:], name) if e.startswith("re:") else f".{e}." in f".{name}."
               for e in entries)  # fmt: skip


def quantize_checkpoint(
    out: Path, model: Any, tokenizer: Any, fmt: str, seed: int, kv_scales: bool = False,
    keep_float: tuple[str, ...] = (),
) -> None:  # fmt: skip
    """Replace ``out``'s weights with an FP8 checkpoint of ``model`` in format ``fmt`` (with
    ``kv_scales``, KV cache scales too); the layers ``keep_float`` names (``kept_float``) stay
    float and join the checkpoint's ignore list, as llm-compressor's recipes leave a Gated
    DeltaNet's projections, the attention or a first layer."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    from services.worker.engine.quantization.fp8_math import FP8, FP8_MAX, quantize_blocks

    if fmt not in FORMATS:
        raise ValueError(f"unknown --quantize {fmt!r}; choose from {', '.join(FORMATS)}")
    if kv_scales and fmt == "fp8-block":
        raise ValueError("KV cache scales are written for the compressed-tensors formats "
                         "(fp8-tensor, fp8-channel)")  # fmt: skip
    experts = _experts(model)
    if experts and fmt == "fp8-tensor":
        raise ValueError("MoE checkpoints are written with dynamic activations (fp8-channel, "
                         "fp8-block)")  # fmt: skip
    gen = torch.Generator().manual_seed(seed + 1)
    linears = _linears(model)
    with torch.no_grad():
        for lin in linears.values():  # outlier channels
            rows = torch.randperm(lin.weight.shape[0], generator=gen)[:2]
            lin.weight[rows] *= 6.0
        for module in experts.values():  # each expert's too
            for w in (module.gate_up_proj, module.down_proj):
                for e in range(w.shape[0]):
                    w[e, torch.randperm(w.shape[1], generator=gen)[:2]] *= 6.0
    amax: dict[str, float] = {}
    if fmt == "fp8-tensor":  # calibrate static activation scales on a text
        hooks = [
            lin.register_forward_pre_hook(
                lambda mod, args, name=name: amax.__setitem__(
                    name, max(amax.get(name, 0.0), float(args[0].abs().max()))
                )
            )
            for name, lin in linears.items()
        ]
        with torch.no_grad():
            model(**tokenizer(_CALIBRATION, return_tensors="pt"))
        for h in hooks:
            h.remove()
    kv_amax = _kv_amax(model, tokenizer) if kv_scales else {}
    model.save_pretrained(out / "unquantized")  # the float model it comes from, to compare
    tokenizer.save_pretrained(out / "unquantized")
    # the checkpoint's names, as save_pretrained wrote them (an expert's projections apart)
    tensors = load_file(out / "unquantized" / "model.safetensors")
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    candidates = [k.removesuffix(".weight") for k in tensors
                  if k.endswith(".weight") and k.rsplit(".", 2)[1] in _QUANTIZED]  # fmt: skip
    unmatched = [e for e in keep_float if not any(kept_float(n, (e,)) for n in candidates)]
    if unmatched:
        raise ValueError(f"keep_float entries naming no layer that would be quantized: {unmatched}")
    quantized = [n for n in candidates if not kept_float(n, keep_float)]
    for name in quantized:
        w = tensors[f"{name}.weight"].float()
        if fmt == "fp8-tensor":
            scale = (w.abs().max() / FP8_MAX).reshape(1)
            tensors[f"{name}.weight"] = (w / scale).to(FP8)
            tensors[f"{name}.weight_scale"] = scale
            tensors[f"{name}.input_scale"] = torch.tensor([amax[name] / FP8_MAX])
        elif fmt == "fp8-channel":
            scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
            tensors[f"{name}.weight"] = (w / scale).to(FP8)
            tensors[f"{name}.weight_scale"] = scale
        else:
            tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"] = quantize_blocks(
                w, BLOCK
            )
    for layer, (k_amax, v_amax) in kv_amax.items():
        prefix = f"model.layers.{layer}.self_attn"
        tensors[f"{prefix}.k_scale"] = torch.tensor(max(k_amax, 1e-12) / FP8_MAX)
        tensors[f"{prefix}.v_scale"] = torch.tensor(max(v_amax, 1e-12) / FP8_MAX)
    for f in out.glob("*.safetensors*"):
        f.unlink()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = qc = _quantization_config(fmt)
    if experts and fmt != "fp8-block":  # (compressed-tensors: the routers are left float)
        qc["ignore"].append("re:.*mlp.gate$")
    floats = [n for n, m in model.named_modules() if _FLOAT.search(n) and hasattr(m, "weight")]
    if floats or keep_float:  # floats each by its name, as the published checkpoints list them
        key = "ignore" if "ignore" in qc else "modules_to_not_convert"
        qc[key] = [*qc.get(key, ["lm_head"]), *floats, *keep_float]
    if kv_scales:
        config["quantization_config"]["kv_cache_scheme"] = {
            "num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
            "strategy": "tensor",
        }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _quantization_config(fmt: str) -> dict[str, Any]:
    if fmt == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK, BLOCK]}  # fmt: skip
    static = fmt == "fp8-tensor"
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                        "strategy": "tensor" if static else "channel"},
            "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                                  "dynamic": not static,
                                  "strategy": "tensor" if static else "token"},
        }},
        "ignore": ["lm_head"],
    }  # fmt: skip


def dequantized_reference(path: str | Path, quantize_activations: bool = True) -> Any:
    """A ``transformers`` model of an FP8 checkpoint with every linear weight dequantized
    (``w_fp8 · scale``, in float32) and, with ``quantize_activations``, each linear input rounded
    through e4m3 the way the checkpoint says: the engine's FP8 layers must agree with it. An
    expert's two inputs are rounded the same way (``_rounding_experts``)."""
    import json

    import torch
    import transformers
    from safetensors import safe_open

    from services.worker.engine.quantization import fp8_math as q
    from services.worker.engine.quantization.config import parse_quantization

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    quant = parse_quantization(config, None)
    assert quant is not None, f"{path} is not an FP8 checkpoint"
    config.pop("quantization_config")
    hf_config = transformers.AutoConfig.for_model(**config)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    tensors = {}
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for k in f.keys():  # noqa: SIM118
            tensors[k] = f.get_tensor(k)
    state = {}
    for k, t in tensors.items():
        if k.endswith((".weight_scale", ".weight_scale_inv", ".input_scale", "_attn.k_scale",
                       "_attn.v_scale")):  # fmt: skip
            continue
        if t.dtype == q.FP8:
            base = k.removesuffix(".weight")
            scale = tensors.get(f"{base}.weight_scale", tensors.get(f"{base}.weight_scale_inv"))
            assert scale is not None
            if quant.weights == "block":
                rows, cols = t.shape
                full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
                t = t.float() * full[:rows, :cols]
            else:
                t = t.float() * scale.float().reshape(-1, 1)
        state[k] = t.float()
    missing, unexpected = model.load_state_dict(stack_experts(state), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if config.get("tie_word_embeddings"):
        model.tie_weights()
    if quantize_activations:
        for name, lin in _linears(model).items():
            if name.endswith("kv_b_proj"):  # the engine multiplies the latent by its weight
                continue  # unrounded, in prefill as in decode (models/layers/mla.py)
            if getattr(tensors.get(f"{name}.weight"), "dtype", None) != q.FP8:
                continue  # a layer the checkpoint keeps float: its input as it is
            static = tensors.get(f"{name}.input_scale")
            if quant.activations == "static":  # the engine's q/k/v (gate/up) share the largest
                prefix, _, own = name.rpartition(".")
                group = next((g for g in _SHARED_INPUT if own in g), (own,))
                static = max(tensors[f"{prefix}.{g}.input_scale"] for g in group)

            def hook(mod: Any, args: tuple[Any, ...], s: Any = static) -> tuple[Any, ...]:
                x = args[0]
                flat = x.reshape(-1, x.shape[-1])
                return (q.quantize_activations(flat, quant.activations, quant.block, s)
                        .reshape(x.shape),)  # fmt: skip

            lin.register_forward_pre_hook(hook)
        for name, experts in _experts(model).items():
            # expert 0's gate in either spelling (Mixtral's w1 under block_sparse_moe)
            mixtral = name.replace(".mlp.", ".block_sparse_moe.")
            gates = [f"{n}.0.{p}.weight" for n in (name, mixtral) for p in ("gate_proj", "w1")]
            if any(getattr(tensors.get(g), "dtype", None) == q.FP8 for g in gates):
                _rounding_experts(experts, quant.activations, quant.block)  # (else float)
    return model.train(False)  # inference mode


def stack_experts(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each layer's per-expert weights stacked as ``transformers`` keeps them
    (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]; Mixtral's
    ``block_sparse_moe`` is its ``mlp``)."""
    import torch

    fused: dict[str, Any] = {}
    parts: dict[str, dict[int, dict[str, Any]]] = {}
    for k, t in state.items():
        m = _EXPERT.match(k)
        if m is None:
            fused[k.replace(".block_sparse_moe.", ".mlp.")] = t
            continue
        proj = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(m[3], m[3])
        parts.setdefault(m[1], {}).setdefault(int(m[2]), {})[proj] = t
    for layer, experts in parts.items():
        ordered = [experts[e] for e in sorted(experts)]
        fused[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([p["gate_proj"], p["up_proj"]]) for p in ordered]
        )
        fused[f"{layer}.mlp.experts.down_proj"] = torch.stack([p["down_proj"] for p in ordered])
    return fused


def reference_gaps(path: str | Path, prompts: list[str], outs: list[Any]) -> list[dict[str, Any]]:
    """Each generated token of ``outs`` (the engine's greedy generations of ``prompts`` with
    logprobs) against ``dequantized_reference(path)`` over the same tokens: per step its
    ``gap`` (|engine logprob - reference logprob|), its ``margin`` (how far below the
    reference's best it lies, in nats), whether it is the reference's ``argmax``, and its
    ``step`` (0: the prefill's token)."""
    import torch
    from transformers import AutoTokenizer

    ref = dequantized_reference(path)
    tok = AutoTokenizer.from_pretrained(path)
    rows = []
    for prompt, out in zip(prompts, outs, strict=True):
        ids = tok(prompt, return_tensors="pt")["input_ids"][0].tolist()
        gen = out.outputs[0].token_ids
        with torch.no_grad():
            logits = ref(torch.tensor([ids + gen])).logits[0].float()
        lps = logits.log_softmax(-1)[len(ids) - 1 : len(ids) - 1 + len(gen)]
        for step, (row, t) in enumerate(zip(lps, gen, strict=True)):
            rows.append({
                "prompt": prompt, "step": step, "argmax": bool(row.argmax() == t),
                "margin": float(row.max() - row[t]),
                "gap": abs(out.outputs[0].logprobs[step][t].logprob - float(row[t])),
            })  # fmt: skip
    return rows


def _rounding_experts(experts: Any, scheme: str, block: int) -> None:
    """``transformers``' expert loop with each expert's input and its down projection's input
    rounded through e4m3 (``scheme``: per token, or per token and ``block`` columns), as the
    engine's FP8 experts round them."""
    import torch
    import torch.nn.functional as F

    from services.worker.engine.quantization.fp8_math import quantize_activations

    def forward(hidden: Any, top_k_index: Any, top_k_weights: Any) -> Any:
        out = torch.zeros_like(hidden)
        for e in range(experts.gate_up_proj.shape[0]):
            token, slot = torch.where(top_k_index == e)
            if token.numel() == 0:
                continue
            x = quantize_activations(hidden[token], scheme, block, None)
            gate, up = F.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
            h = quantize_activations(experts.act_fn(gate) * up, scheme, block, None)
            y = F.linear(h, experts.down_proj[e]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    experts.forward = forward
