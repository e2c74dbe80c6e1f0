"""Maps a checkpoint's ``architectures`` name to a model class, imported lazily.

The names are checked at config time without importing torch; the class is imported when the
worker builds the model. One decoder class covers the Llama family: the differences (q/k/v
bias, q/k norm, tied embeddings, RoPE scaling, mixture-of-experts layers) are read from
``ArchConfig``.
"""

import importlib

_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "services.worker.engine.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "services.worker.engine.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "services.worker.engine.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "services.worker.engine.models.llama:LlamaForCausalLM",
    "DeepseekV2ForCausalLM": "services.worker.engine.models.deepseek_v2:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "services.worker.engine.models.deepseek_v2:DeepseekV2ForCausalLM",
    "Qwen3MoeForCausalLM": "services.worker.engine.models.llama:LlamaForCausalLM",
    "MixtralForCausalLM": "services.worker.engine.models.llama:LlamaForCausalLM",
    "GptOssForCausalLM": "services.worker.engine.models.gpt_oss:GptOssForCausalLM",
    "Glm4MoeForCausalLM": "services.worker.engine.models.llama:Glm4MoeForCausalLM",
    "MiniMaxM2ForCausalLM": "services.worker.engine.models.minimax_m2:MiniMaxM2ForCausalLM",
    "Gemma3ForCausalLM": "services.worker.engine.models.gemma3:Gemma3ForCausalLM",
    "Qwen3_5ForCausalLM": "services.worker.engine.models.qwen3_5:Qwen3_5ForCausalLM",
    # (its text decoder: the vision encoder's weights are not loaded, images are refused)
    "Qwen3_5ForConditionalGeneration": "services.worker.engine.models.qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3NextForCausalLM": "services.worker.engine.models.qwen3_5:Qwen3NextForCausalLM",
    "Qwen3_5MoeForCausalLM": "services.worker.engine.models.qwen3_5:Qwen3_5MoeForCausalLM",
}
_QWEN3_5_MOE = "services.worker.engine.models.qwen3_5:Qwen3_5MoeForCausalLM"
_MODELS["Qwen3_5MoeForConditionalGeneration"] = _QWEN3_5_MOE  # (its text decoder, as above)


# the architectures whose models apply the config's sliding window (on its ``layer_types``); the
# others attend over every key, which equals the window's attention only inside it
_WINDOWED = frozenset({"GptOssForCausalLM", "Gemma3ForCausalLM"})


def applies_sliding_window(name: str) -> bool:
    return name in _WINDOWED


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def check_architecture(name: str) -> None:
    if name not in _MODELS:
        raise ValueError(
            f"unsupported model architecture {name!r}; supported: "
            + ", ".join(supported_architectures())
        )


def resolve_model_class(name: str) -> type:
    check_architecture(name)
    module, _, cls = _MODELS[name].partition(":")
    return getattr(importlib.import_module(module), cls)
