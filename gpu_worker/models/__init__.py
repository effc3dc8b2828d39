"""Our own model code, by Hugging Face `model_type` (the list the launcher checks without importing torch:
common/model_info.py SUPPORTED_MODEL_TYPES; a test keeps the two equal)."""

from __future__ import annotations

from common.model_info import UnsupportedModel, check_supported
from gpu_worker.models.gemma import GemmaForCausalLM
from gpu_worker.models.gpt2 import GPT2ForCausalLM
from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.models.olmo2 import Olmo2ForCausalLM

MODEL_CLASSES = {
    "gpt2": GPT2ForCausalLM,
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "phi3": LlamaForCausalLM,
    "mixtral": LlamaForCausalLM,
    "qwen3_moe": LlamaForCausalLM,
    "gemma2": GemmaForCausalLM,
    "gemma3_text": GemmaForCausalLM,
    "olmo2": Olmo2ForCausalLM,
}

__all__ = ["MODEL_CLASSES", "UnsupportedModel", "model_class_for"]


def model_class_for(config) -> type:
    check_supported(config.model_type, getattr(config, "architectures", None))
    return MODEL_CLASSES[config.model_type]
