"""Our own model code, by Hugging Face `model_type`."""

from __future__ import annotations

from gpu_worker.models.gpt2 import GPT2ForCausalLM
from gpu_worker.models.llama import LlamaForCausalLM

MODEL_CLASSES = {
    "gpt2": GPT2ForCausalLM,
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
}


class UnsupportedModel(ValueError):
    pass


def model_class_for(config) -> type:
    cls = MODEL_CLASSES.get(config.model_type)
    if cls is None:
        raise UnsupportedModel(
            f"model_type {config.model_type!r} is not supported; supported: {', '.join(sorted(MODEL_CLASSES))}"
        )
    return cls
