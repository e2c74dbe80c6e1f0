"""The mixture-of-experts layer on CPU: routing against Hugging Face's own routers (Qwen3-MoE,
Mixtral, DeepSeek-V2 greedy and group-limited, DeepSeek-V3's biased sigmoid groups), the
experts' plain-PyTorch path against a token-by-token loop, split over two ranks (an expert's
intermediate slice each, or whole experts with expert parallelism) summing to the whole, FP8
experts (per channel, 128×128 blocks, quantized at load) against dequantized weights, and the
refusals: sizes that do not split, scales of the wrong shape, an expert left unloaded."""

import functools
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers

from baton.cli import build_parser
from baton.engine_flags import engine_args
from services.worker.engine.config import EngineArgs
from services.worker.engine.distributed.parallel_state import GroupCoordinator, use_tp_group
from services.worker.engine.model_config import MoEConfig, load_arch_config
from services.worker.engine.models.layers.moe import FusedMoE, Router, expert_target
from services.worker.engine.quantization import fp8_math as q
from services.worker.engine.quantization.config import QuantConfig
from services.worker.engine.quantization.registry import moe_method

T, H = 7, 32  # tokens, hidden size

_V2, _V3 = "deepseek_v2.modeling_deepseek_v2", "deepseek_v3.modeling_deepseek_v3"
# name → (transformers config class, its router's module and class, config fields)
ROUTERS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3_moe": ("Qwen3MoeConfig", "qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter",
                  {"num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": True}),
    "qwen3_moe-unnormalized": ("Qwen3MoeConfig", "qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter",
                               {"num_experts": 16, "num_experts_per_tok": 4}),
    "mixtral": ("MixtralConfig", "mixtral.modeling_mixtral.MixtralTopKRouter",
                {"num_local_experts": 8, "num_experts_per_tok": 2}),
    "deepseek_v2-greedy": ("DeepseekV2Config", f"{_V2}.DeepseekV2TopkRouter",
                           {"n_routed_experts": 16, "num_experts_per_tok": 3,
                            "routed_scaling_factor": 1.5}),
    "deepseek_v2-groups": ("DeepseekV2Config", f"{_V2}.DeepseekV2TopkRouter",
                           {"n_routed_experts": 16, "num_experts_per_tok": 3, "n_group": 4,
                            "topk_group": 2, "topk_method": "group_limited_greedy",
                            "routed_scaling_factor": 1.5}),
    "deepseek_v3": ("DeepseekV3Config", f"{_V3}.DeepseekV3TopkRouter",
                    {"n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4,
                     "topk_group": 2, "norm_topk_prob": True, "routed_scaling_factor": 2.5}),
}  # fmt: skip


def _hf_router(name: str, tmp_path: Path) -> tuple[Any, MoEConfig]:
    """Hugging Face's router of a config, and our ``MoEConfig`` parsed from its config.json."""
    cls_name, router, fields = ROUTERS[name]
    config = getattr(transformers, cls_name)(hidden_size=H, num_hidden_layers=2,
                                             num_attention_heads=2, moe_intermediate_size=8,
                                             **fields)  # fmt: skip
    arch = cls_name.removesuffix("Config") + "ForCausalLM"
    (tmp_path / "config.json").write_text(
        json.dumps({**json.loads(config.to_json_string()), "architectures": [arch]})
    )
    moe = load_arch_config(tmp_path).moe
    assert moe is not None
    module, _, cls = router.rpartition(".")
    hf = getattr(__import__(f"transformers.models.{module}", fromlist=[cls]), cls)(config)
    return hf, moe


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_routing_is_hugging_faces(name: str, tmp_path: Path) -> None:
    hf, moe = _hf_router(name, tmp_path)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hf.weight.shape, generator=gen))
        bias = getattr(hf, "e_score_correction_bias", None)
        if bias is not None:  # a bias that really moves the choice
            bias.copy_(torch.rand(bias.shape, generator=gen) * 0.5)
    assert moe.correction_bias == (bias is not None)
    x = torch.randn(64, H, generator=gen)
    _, hf_weights, hf_ids = hf(x)
    ours = Router(H, moe)
    ours.weight.data.copy_(hf.weight)
    if bias is not None:
        assert ours.e_score_correction_bias is not None
        ours.e_score_correction_bias.data.copy_(bias)
    from services.worker.engine.models.layers.moe import select_experts

    weights, ids = select_experts(ours(x), moe, ours.e_score_correction_bias)
    assert weights.dtype == torch.float32 and ids.shape == (64, moe.top_k)
    # the same experts, each with the same weight (in whatever order top-k lists them)
    order, hf_order = ids.argsort(-1), hf_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.float().gather(1, hf_order),
                               rtol=1e-6, atol=1e-7)  # fmt: skip
    assert len(ids.unique()) > moe.num_experts // 2  # (routing is not degenerate)


def test_the_router_computes_in_its_models_dtype() -> None:
    """As Hugging Face's gates: Qwen3-MoE's, Mixtral's and gpt-oss's logits in the model's dtype
    (one GEMV, no cast of x), DeepSeek's in float32 (the gate casts x and its weight)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, H, generator=gen).to(torch.bfloat16)
    weight = torch.randn(8, H, generator=gen)
    for float32 in (False, True):
        moe = MoEConfig(num_experts=8, top_k=2, intermediate_size=8, router_float32=float32)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            router = Router(H, moe)
        finally:
            torch.set_default_dtype(previous)
        router.weight.data.copy_(weight)
        logits = router(x)
        if float32:
            assert router.weight.dtype == torch.float32
            assert torch.equal(logits, F.linear(x.float(), weight))
        else:
            assert router.weight.dtype == torch.bfloat16
            assert torch.equal(logits, F.linear(x, weight.to(torch.bfloat16)))


def _moe(e: int = 4, k: int = 2, inter: int = 16) -> MoEConfig:
    return MoEConfig(num_experts=e, top_k=k, intermediate_size=inter)


def _checkpoint(moe: MoEConfig, hidden: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Per-expert float weights under a layer's checkpoint names (Mixtral's spelling for odd
    experts: both name schemes map)."""
    gen = torch.Generator().manual_seed(seed)
    i, out = moe.intermediate_size, {}
    for e in range(moe.num_experts):
        names = ("w1", "w3", "w2") if e % 2 else ("gate_proj", "up_proj", "down_proj")
        for name, shape in zip(names, ((i, hidden), (i, hidden), (hidden, i)), strict=True):
            w = torch.randn(shape, generator=gen) / shape[1] ** 0.5
            w[e % shape[0]] *= 6.0  # an outlier row: per-channel scales must differ
            out[f"layer.experts.{e}.{name}.weight"] = w
    return out


def _routing(moe: MoEConfig, tokens: int = T) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(moe.num_experts, generator=gen)[: moe.top_k]
                       for _ in range(tokens)])  # fmt: skip
    return torch.rand(tokens, moe.top_k, generator=gen), ids


def _build(moe: MoEConfig, hidden: int, tensors: dict[str, torch.Tensor], quant: Any = None,
           ep: bool = False) -> FusedMoE:  # fmt: skip
    layer = FusedMoE(moe, hidden, moe_method(quant, kernels=False), ep)
    params = dict(layer.named_parameters())
    for name, t in tensors.items():
        target = expert_target(name)
        assert target is not None, name
        layer.weight_loader(params[target.param.removeprefix("layer.experts.")], t, target.shard)
    return layer


def _read_as_rank(
    moe: MoEConfig, file: Path, target_of: Any, quant: Any = None, ep: bool = False
) -> tuple[FusedMoE, int]:
    """A layer loaded from the safetensors ``file`` as this rank loads a checkpoint (each tensor
    lazy, narrowed to what the rank needs before it is read; ``target_of``: a name's target),
    and the bytes it read."""
    from safetensors import safe_open

    from services.worker.engine.models.weights import CheckpointTensor, ReadCounter

    layer = FusedMoE(moe, H, moe_method(quant, kernels=False), ep)
    params, counter = dict(layer.named_parameters()), ReadCounter()
    with safe_open(str(file), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            target = target_of(name)
            assert target is not None
            param = params[target.param.removeprefix("layer.experts.")]
            layer.weight_loader(param, CheckpointTensor.of(f.get_slice(name), counter),
                                target.shard)  # fmt: skip
    return layer, counter.bytes


def _naive(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
           expert: Any) -> torch.Tensor:  # fmt: skip
    """Token by token, slot by slot."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            out[t] += weights[t, j] * expert(int(ids[t, j]), x[t : t + 1])[0]
    return out


def _float_expert(tensors: dict[str, torch.Tensor]) -> Any:
    def expert(e: int, x: torch.Tensor) -> torch.Tensor:
        names = ("w1", "w3", "w2") if e % 2 else ("gate_proj", "up_proj", "down_proj")
        g, u, d = (tensors[f"layer.experts.{e}.{n}.weight"] for n in names)
        return F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d)

    return expert


@pytest.mark.parametrize("ep", [False, True], ids=["tp-slices", "expert-parallel"])
def test_experts_match_a_token_loop_and_split_over_two_ranks(ep: bool) -> None:
    moe = _moe()
    tensors = _checkpoint(moe, H)
    weights, ids = _routing(moe)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    want = _naive(x, weights, ids, _float_expert(tensors))
    whole = _build(moe, H, tensors)
    assert whole.unloaded_weights() == []
    torch.testing.assert_close(whole(x, weights, ids), want, rtol=1e-5, atol=1e-6)
    parts = []
    for rank in range(2):
        with use_tp_group(GroupCoordinator(rank, 2)):
            layer = _build(moe, H, tensors, ep=ep)
        expect = (2, 2 * 16, H) if ep else (4, 2 * 8, H)  # whole experts, or half of each
        assert tuple(layer.w13_weight.shape) == expect  # type: ignore[arg-type]
        parts.append(layer(x, weights, ids))
    torch.testing.assert_close(parts[0] + parts[1], want, rtol=1e-5, atol=1e-6)
    if ep:  # each rank adds only its own experts' share
        mine = (ids < 2).float()
        own = _naive(x, weights * mine, ids, _float_expert(tensors))
        torch.testing.assert_close(parts[0], own, rtol=1e-5, atol=1e-6)


def test_an_expert_left_unloaded_is_named() -> None:
    moe = _moe()
    tensors = _checkpoint(moe, H)
    del tensors["layer.experts.2.up_proj.weight"]
    assert _build(moe, H, tensors).unloaded_weights() == ["experts.2.up_proj"]


def _fp8_checkpoint(tensors: dict[str, torch.Tensor], block: int | None) -> dict[str, torch.Tensor]:
    out = {}
    for name, w in tensors.items():
        base = name.removesuffix(".weight")
        if block is None:
            out[name], out[f"{base}.weight_scale"] = q.quantize_rows(w)
        else:  # as block checkpoints store it (``weight_scale_inv``; the loader renames)
            out[name], out[f"{base}.weight_scale"] = q.quantize_blocks(w, block)
    return out


def _fp8_expert(fp8: dict[str, torch.Tensor], scheme: str, block: int | None) -> Any:
    def weight(name: str) -> torch.Tensor:
        w, s = fp8[f"{name}.weight"], fp8[f"{name}.weight_scale"]
        if block is not None:
            s = s.repeat_interleave(block, 0).repeat_interleave(block, 1)
        return w.float() * s[: w.shape[0], : w.shape[1]]

    def expert(e: int, x: torch.Tensor) -> torch.Tensor:
        names = ("w1", "w3", "w2") if e % 2 else ("gate_proj", "up_proj", "down_proj")
        g, u, d = (weight(f"layer.experts.{e}.{n}") for n in names)
        xq = q.quantize_activations(x, scheme, block or 128, None)
        h = F.silu(F.linear(xq, g)) * F.linear(xq, u)
        return F.linear(q.quantize_activations(h, scheme, block or 128, None), d)

    return expert


FP8_CASES = {
    "channel": (QuantConfig("channel", "token"), None, 16),
    "block": (QuantConfig("block", "token_group"), 128, 256),
}


@pytest.mark.parametrize("fmt", sorted(FP8_CASES))
def test_fp8_experts_match_their_dequantized_weights(fmt: str) -> None:
    quant, block, inter = FP8_CASES[fmt]
    hidden = 128 if block else H
    moe = _moe(inter=inter)
    fp8 = _fp8_checkpoint(_checkpoint(moe, hidden), block)
    weights, ids = _routing(moe)
    x = torch.randn(T, hidden, generator=torch.Generator().manual_seed(2))
    want = _naive(x, weights, ids, _fp8_expert(fp8, quant.activations, block))
    layer = _build(moe, hidden, fp8, quant)
    assert layer.w13_weight.dtype == q.FP8
    torch.testing.assert_close(layer(x, weights, ids), want, rtol=1e-5, atol=1e-5)
    # two ranks: two whole experts each, or half of each expert's intermediate columns (for
    # blocks: its block rows and columns). Split per channel, each rank rounds the down
    # projection's input per token over its own half (as a dense row-parallel layer does):
    # close to one rank's, not the same
    for ep in (True, False):
        parts = []
        for rank in range(2):
            with use_tp_group(GroupCoordinator(rank, 2)):
                parts.append(_build(moe, hidden, fp8, quant, ep=ep)(x, weights, ids))
        atol = 1e-5 if ep or block else 5e-3 * float(want.abs().max())
        torch.testing.assert_close(parts[0] + parts[1], want, rtol=1e-5, atol=atol)


def test_a_float_checkpoint_quantized_at_load_is_the_channel_checkpoint() -> None:
    moe = _moe()
    tensors = _checkpoint(moe, H)
    weights, ids = _routing(moe)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    online = _build(moe, H, tensors, QuantConfig("channel", "token", online=True))
    stored = _build(moe, H, _fp8_checkpoint(tensors, None), QuantConfig("channel", "token"))
    assert online.derived_parameters() == ("w13_weight_scale", "w2_weight_scale")
    assert torch.equal(online.w13_weight.float(), stored.w13_weight.float())  # type: ignore[arg-type]
    assert torch.equal(online(x, weights, ids), stored(x, weights, ids))


def test_fp8_refusals_say_what_is_wrong() -> None:
    moe = _moe()
    with pytest.raises(ValueError, match="static activation scales"):
        FusedMoE(moe, H, moe_method(QuantConfig("tensor", "static"), False), False)
    with pytest.raises(ValueError, match=r"intermediate size \(16\) to be a multiple of 128"):
        FusedMoE(moe, 128, moe_method(QuantConfig("block", "token_group"), False), False)
    with pytest.raises(ValueError, match="no mixture-of-experts method for 'int4' weights"):
        FusedMoE(moe, H, moe_method(QuantConfig("int4", "token"), False), False)
    fp8 = _fp8_checkpoint(_checkpoint(moe, H), None)
    fp8["layer.experts.1.w1.weight_scale"] = fp8["layer.experts.1.w1.weight_scale"][:10]
    with pytest.raises(ValueError, match=r"gate projection, expected \(16,\)"):
        _build(moe, H, fp8, QuantConfig("channel", "token"))


def _engine_config(tmp_path: Path, **kw: Any) -> Any:
    config = transformers.Qwen3MoeConfig(hidden_size=64, num_hidden_layers=2, head_dim=8,  # type: ignore[call-arg]
                                         num_attention_heads=8, num_key_value_heads=2,
                                         num_experts=6, moe_intermediate_size=12,
                                         intermediate_size=64)  # fmt: skip
    cfg = {**json.loads(config.to_json_string()), "architectures": ["Qwen3MoeForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return EngineArgs(model=str(tmp_path), device="cpu", **kw).create_engine_config()


def test_sizes_that_do_not_split_are_refused(tmp_path: Path) -> None:
    """6 experts of intermediate size 12: TP=2 splits each expert, or 3 whole experts a rank;
    TP=4 neither (12/4 = 3 splits, 6/4 experts does not)."""
    assert _engine_config(tmp_path, tensor_parallel_size=2).parallel.tensor_parallel_size == 2
    ep = _engine_config(tmp_path, tensor_parallel_size=2, enable_expert_parallel=True)
    assert ep.parallel.enable_expert_parallel
    assert _engine_config(tmp_path, tensor_parallel_size=4).parallel.tensor_parallel_size == 4
    with pytest.raises(ValueError, match=r"num_experts \(enable_expert_parallel\)=6"):
        _engine_config(tmp_path, tensor_parallel_size=4, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="moe_intermediate_size=12"):
        _engine_config(tmp_path, tensor_parallel_size=8)


def test_the_expert_parallel_flag_reaches_the_engine() -> None:
    args = build_parser().parse_args(["worker", "--model", "m", "--enable-expert-parallel"])
    assert engine_args(args).enable_expert_parallel
    plain = build_parser().parse_args(["worker", "--model", "m"])
    assert not engine_args(plain).enable_expert_parallel


def test_an_fp8_expert_without_its_scale_is_named() -> None:
    """A scale left at its fill would zero that expert's product: the loader must refuse it."""
    moe = _moe()
    fp8 = _fp8_checkpoint(_checkpoint(moe, H), None)
    assert _build(moe, H, fp8, QuantConfig("channel", "token")).unloaded_weights() == []
    del fp8["layer.experts.3.w2.weight_scale"]
    missing = _build(moe, H, fp8, QuantConfig("channel", "token")).unloaded_weights()
    assert missing == ["experts.3.down_proj weight scale"]


@pytest.mark.parametrize("shape", ["rows", "one-row", "one-value"])
def test_a_per_channel_scale_loads_however_it_is_shaped(shape: str) -> None:
    """A per-channel scale as [rows] or [1, rows] (not [rows, 1]), and a per-tensor scale
    (one value), give each of two ranks the weights of [rows, 1] scales."""
    moe = _moe(inter=256)
    fp8 = _fp8_checkpoint(_checkpoint(moe, H), None)
    if shape == "one-value":  # each tensor's largest scale for all its rows, requantized
        for name in [n for n in fp8 if n.endswith(".weight")]:
            w = fp8[name].float() * fp8[f"{name}_scale"]
            scale = fp8[f"{name}_scale"].max()
            fp8[name], fp8[f"{name}_scale"] = (w / scale).to(q.FP8), scale.reshape(())
    quant = QuantConfig("channel", "token")
    scales = [n for n in fp8 if n.endswith("_scale") and shape != "one-value"]
    reshaped = {n: fp8[n].reshape(-1) if shape == "rows" else fp8[n].reshape(1, -1)
                for n in scales}  # fmt: skip
    for rank in range(2):
        with use_tp_group(GroupCoordinator(rank, 2)):
            want = _build(moe, H, fp8, quant)
            got = _build(moe, H, {**fp8, **reshaped}, quant)
        for name, value in want.named_parameters():
            torch.testing.assert_close(dict(got.named_parameters())[name], value, rtol=0, atol=0)
        if shape == "one-value":  # its one value on every row of its projection
            gate_rows = want.w13_weight_scale[1, : want.intermediate_size, 0]
            assert torch.equal(gate_rows, gate_rows[:1].expand_as(gate_rows))
            assert gate_rows[0] == fp8["layer.experts.1.w1.weight_scale"]  # (expert 1: w1)


@pytest.mark.parametrize("block", [None, 128], ids=["per-channel", "blocks"])
def test_a_scale_of_the_wrong_shape_is_refused(block: int | None) -> None:
    """A scale that is not one value a row (or a block) of its projection is refused, naming
    the shape it should have."""
    moe = _moe(inter=256)
    fp8 = _fp8_checkpoint(_checkpoint(moe, H), block)
    fp8["layer.experts.2.gate_proj.weight_scale"] = torch.ones(3, 2)
    quant = QuantConfig("block", "token_group") if block else QuantConfig("channel", "token")
    want = "(2, 1)" if block else "(256,)"
    message = f"of shape (3, 2) does not match the expert's gate projection, expected {want}"
    with pytest.raises(ValueError, match=re.escape(message)):
        _build(moe, H, fp8, quant)


def test_an_expert_past_the_configs_count_is_refused() -> None:
    moe = _moe()
    tensors = _checkpoint(moe, H)
    tensors[f"layer.experts.{moe.num_experts}.gate_proj.weight"] = torch.zeros(16, H)
    with pytest.raises(ValueError, match=f"expert {moe.num_experts} of a layer of"):
        _build(moe, H, tensors)


@pytest.mark.parametrize("ep", [False, True], ids=["tp-slices", "expert-parallel"])
@pytest.mark.parametrize("block", [None, 0, 128], ids=["float", "fp8-channel", "fp8-block"])
def test_per_expert_tensors_are_read_only_for_this_ranks_share(
    block: int | None, ep: bool, tmp_path: Path
) -> None:
    """The per-expert layout (Qwen3-MoE's, Mixtral's and DeepSeek's checkpoints; FP8 per
    channel, and in DeepSeek's 128 × 128 blocks), read from the file by each of two ranks:
    with slices, half of gate's and up's rows and of down's columns, with their scales' rows
    or blocks (down's per-channel scales, one a hidden row, whole); with expert parallelism,
    its half of the experts, whole. And the same weights as a rank built from whole tensors."""
    from safetensors.torch import save_file

    moe = _moe(inter=256)  # two 128-wide blocks of the intermediate dimension, one a rank
    tensors = _checkpoint(moe, H)
    quant = None
    if block is not None:
        tensors = _fp8_checkpoint(tensors, block or None)
        quant = QuantConfig("block" if block else "channel", "token_group" if block else "token")
    save_file(tensors, str(tmp_path / "experts.safetensors"))

    def share(name: str, t: torch.Tensor, rank: int) -> int:
        """The bytes of ``name`` that rank ``rank`` must read."""
        if ep:
            return t.numel() * t.element_size() if int(name.split(".")[2]) % 2 == rank else 0
        down = name.split(".")[3] in ("w2", "down_proj")
        if down and name.endswith("weight_scale") and not block:
            return t.numel() * t.element_size()  # one scale a hidden row: every rank's
        return t.numel() * t.element_size() // 2  # half the rows (gate, up) or columns (down)

    for rank in range(2):
        with use_tp_group(GroupCoordinator(rank, 2)):
            want = _build(moe, H, tensors, quant, ep=ep)
            layer, read = _read_as_rank(moe, tmp_path / "experts.safetensors", expert_target,
                                        quant, ep)  # fmt: skip
        assert layer.unloaded_weights() == []
        params = dict(layer.named_parameters())
        for name, value in want.named_parameters():
            torch.testing.assert_close(params[name], value, rtol=0, atol=0)
        assert read == sum(share(n, t, rank) for n, t in tensors.items())


@pytest.mark.parametrize("ep", [False, True], ids=["tp-slices", "expert-parallel"])
def test_stacked_experts_load_each_ranks_rows_and_read_only_them(ep: bool, tmp_path: Path) -> None:
    """transformers' stacked layout (Qwen3.5-MoE's bf16 checkpoints: ``gate_up_proj``
    [E, 2I, H], gate's rows then up's; ``down_proj`` [E, H, I]) loads as the per-expert
    tensors do, and a rank reads from the file only its share: half of every expert's rows
    (or its half of the experts)."""
    from safetensors.torch import save_file

    from services.worker.engine.models.layers.moe import stacked_expert_target

    moe = _moe()
    tensors = _checkpoint(moe, H)
    per = [("w1", "w3", "w2") if e % 2 else ("gate_proj", "up_proj", "down_proj")
           for e in range(moe.num_experts)]  # fmt: skip
    w = {n: [tensors[f"layer.experts.{e}.{p[k]}.weight"] for e, p in enumerate(per)]
         for k, n in enumerate(("gate", "up", "down"))}  # fmt: skip
    stacked = {
        "layer.experts.gate_up_proj": torch.stack(
            [torch.cat([g, u]) for g, u in zip(w["gate"], w["up"], strict=True)]),
        "layer.experts.down_proj": torch.stack(w["down"]),
    }  # fmt: skip
    save_file(stacked, str(tmp_path / "experts.safetensors"))
    whole = sum(t.numel() * 4 for t in stacked.values())
    for rank in range(2):
        with use_tp_group(GroupCoordinator(rank, 2)):
            want = _build(moe, H, tensors, ep=ep)
            target = functools.partial(stacked_expert_target, interleaved=False)
            layer, read = _read_as_rank(moe, tmp_path / "experts.safetensors", target, ep=ep)
        assert layer.unloaded_weights() == []
        for name in ("w13_weight", "w2_weight"):
            torch.testing.assert_close(getattr(layer, name), getattr(want, name), rtol=0, atol=0)
        assert read == whole // 2
