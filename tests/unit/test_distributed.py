"""The tensor-parallel group's collectives over gloo between two real processes, and what one
rank reads of a checkpoint: only its slice of every split weight, equal to that slice of the
Hugging Face tensors, for single-file and sharded checkpoints, tied and untied embeddings."""

import multiprocessing as mp
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from services.worker.engine.config import EngineArgs
from services.worker.engine.distributed import parallel_state
from services.worker.engine.distributed.parallel_state import (
    GroupCoordinator,
    StoreSpec,
    destroy_tensor_parallel,
    init_tensor_parallel,
)
from services.worker.engine.models.loader import checkpoint_files
from services.worker.engine.worker.model_runner import ModelRunner


def _collectives(
    rank: int, store: str, out: "mp.Queue[tuple[int, dict[str, list[float]]]]"
) -> None:
    init_tensor_parallel(rank, 2, StoreSpec(store), "gloo")
    tp = parallel_state.get_tp_group()
    x = torch.tensor([1.0, 2.0]) * (rank + 1)
    reduced = tp.all_reduce(x.clone())
    gathered = tp.all_gather(x)
    on_zero = tp.gather(x)
    b = torch.tensor([float(rank + 10)])
    tp.broadcast(b)
    out.put((rank, {
        "reduced": reduced.tolist(), "gathered": gathered.tolist(), "broadcast": b.tolist(),
        "gather": on_zero.tolist() if on_zero is not None else [],
    }))  # fmt: skip
    destroy_tensor_parallel()


def test_collectives_between_two_processes(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_collectives, args=(r, f"file:{tmp_path}/store", out))
             for r in range(2)]  # fmt: skip
    for p in procs:
        p.start()
    got = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for rank in range(2):
        assert got[rank]["reduced"] == [3.0, 6.0]
        assert got[rank]["gathered"] == [1.0, 2.0, 2.0, 4.0]
        assert got[rank]["broadcast"] == [10.0]
    assert got[0]["gather"] == [1.0, 2.0, 2.0, 4.0]
    assert got[1]["gather"] == []  # rank 0 only


def test_a_world_of_one_is_the_identity() -> None:
    tp = GroupCoordinator(0, 1)
    x = torch.arange(4.0)
    assert tp.all_reduce(x) is x and tp.all_gather(x) is x and tp.gather(x) is x
    assert tp.broadcast(x) is x and tp.is_driver


def _hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return out


def _load_as_rank(path: Path, rank: int, size: int) -> ModelRunner:
    config = EngineArgs(model=str(path)).create_engine_config()
    with parallel_state.use_tp_group(GroupCoordinator(rank, size)):  # no collectives
        runner = ModelRunner(config, torch.device("cpu"))
        runner.load_model(show_progress=False)
    return runner


@pytest.mark.parametrize("fmt", ["fp8-tensor", "fp8-channel"])
def test_each_rank_reads_only_its_slices_of_an_fp8_checkpoint(tmp_path: Path, fmt: str) -> None:
    """As below, with the scales: a column-parallel layer's per-channel scales split with its
    rows; a row-parallel layer's (o, down: one a row, which every rank keeps) and a per-tensor
    scale whole."""
    from baton.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path / fmt, arch="llama", quantize=fmt)
    hf = _hf_tensors(path)

    def whole(name: str) -> bool:
        row_parallel = name.rpartition(".")[0].endswith(("o_proj", "down_proj"))
        scale = name.endswith(("weight_scale", "input_scale"))
        return name.endswith("norm.weight") or (scale and (row_parallel or hf[name].numel() == 1))

    total = sum(t.numel() * t.element_size() for t in hf.values())
    replicated = sum(t.numel() * t.element_size() for k, t in hf.items() if whole(k))
    assert any(k.endswith("weight_scale") and not whole(k) for k in hf) == (fmt == "fp8-channel")
    for rank in range(2):
        assert _load_as_rank(path, rank, 2).read.bytes == (total - replicated) // 2 + replicated


@pytest.mark.parametrize("name", ["llama", "llama3-tied", "qwen2-sharded"])
def test_each_rank_reads_only_its_slices(tiny_models: dict[str, Path], name: str) -> None:
    path = tiny_models[name]
    hf = _hf_tensors(path)
    total = sum(t.numel() * t.element_size() for t in hf.values())
    replicated = sum(
        t.numel() * t.element_size() for k, t in hf.items() if k.endswith("norm.weight")
    )
    for rank in range(2):
        runner = _load_as_rank(path, rank, 2)
        # every split weight half (embeddings and LM head too), the norms whole
        assert runner.read.bytes == (total - replicated) // 2 + replicated
        model, half = runner.model, slice(rank * 32, (rank + 1) * 32)
        layer = model.model.layers[0]
        q, k = (
            hf["model.layers.0.self_attn.q_proj.weight"],
            hf["model.layers.0.self_attn.k_proj.weight"],
        )
        qkv = layer.self_attn.qkv_proj.weight
        assert torch.equal(qkv[:32], q[half])  # 2 of 4 query heads of 16 dims
        assert torch.equal(qkv[32:48], k[rank * 16 : (rank + 1) * 16])  # 1 of 2 KV heads
        o = hf["model.layers.0.self_attn.o_proj.weight"]
        assert torch.equal(layer.self_attn.o_proj.weight, o[:, half])  # row-parallel: columns
        emb = hf["model.embed_tokens.weight"]
        rows = emb.shape[0] // 2
        assert torch.equal(model.model.embed_tokens.weight, emb[rank * rows : (rank + 1) * rows])
        if "model.layers.0.self_attn.q_proj.bias" in hf:  # qwen2: q/k/v biases split with heads
            bias = hf["model.layers.0.self_attn.q_proj.bias"]
            assert torch.equal(layer.self_attn.qkv_proj.bias[:32], bias[half])
