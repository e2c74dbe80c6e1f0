"""A GGUF file as Hugging Face transformers reads it: the oracle that tests and
``benchmarks/quality.py`` hold Baton's outputs to, on the same dequantized weights.
``transformers_model(path)`` is what ``from_pretrained(gguf_file=...)`` would build (which wants
``accelerate``, not a dependency of ours); ``transformers_tokenizer(path)`` its tokenizer and
chat template. Imports transformers and torch: not for the torch-free services.
"""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig
from transformers.initialization import no_init_weights
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint


class _Names:
    """What transformers' GGUF loader asks of a model to name the file's tensors: a config and
    parameter names (handed a model, it builds a name table for each of its submodules: 5 s
    here). Those of a Llama of 64 layers, more than the file has."""

    def __init__(self) -> None:
        config = LlamaConfig(
            num_hidden_layers=64, hidden_size=8, intermediate_size=8, num_attention_heads=1
        )
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        self.config, self.names = model.config, model.state_dict()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.names

    def named_children(self) -> Iterator[tuple[str, Any]]:
        return iter(())


def transformers_model(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' own reading of the file: its config, and its tensors dequantized and
    un-permuted, in ``dtype`` (a model with tied embeddings, as SmolLM2)."""
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=_Names())
    config = AutoConfig.for_model(**parsed["config"])
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    result = model.load_state_dict(parsed["tensors"], strict=False)
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys  # tied
    model.tie_weights()
    return model.train(False)  # inference mode for every submodule


def transformers_tokenizer(path: Path) -> Any:
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
