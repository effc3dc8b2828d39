"""Facts about a model folder that several processes need: context length, end-of-sequence ids, whether the
engine runs its architecture."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from common.checkpoint_quantization import checkpoint_quantization

# The Hugging Face model types the GPU worker has model code for (gpu_worker/models/__init__.py maps each to its
# class). Here, so that the launcher refuses another before starting a process, without importing torch.
SUPPORTED_MODEL_TYPES = (
    "gemma2",
    "gemma3_text",
    "gpt2",
    "llama",
    "mistral",
    "mixtral",
    "olmo2",
    "phi3",
    "qwen2",
    "qwen3",
    "qwen3_moe",
)


class UnsupportedModel(ValueError):
    """The engine has no model code for this architecture."""


def check_supported(model_type: str, architectures: list[str] | None = None) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        named = f" ({', '.join(architectures)})" if architectures else ""
        raise UnsupportedModel(
            f"model_type {model_type!r}{named} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


# A GGUF file's architecture (llama.cpp's name, its general.architecture) for each family whose GGUF files transformers'
# reader converts into a folder we run (common/model_source.py), and the model_type it becomes; each tested
# (tests/test_model_families.py). Mistral's files are llama ones.
GGUF_ARCHITECTURES = {
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "gpt2": "gpt2",
    "llama": "llama",
    "phi3": "phi3",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}
# Families we run whose GGUF files do not convert, and why (a safetensors folder of each runs).
GGUF_NOT_CONVERTED = {
    "olmo2": "transformers' GGUF reader has no olmo2",
    "qwen3moe": "transformers' GGUF reader does not convert its stacked experts (tried with transformers 5.24)",
}


def check_gguf_supported(path: str | Path) -> None:
    """UnsupportedModel, in one line, unless the GGUF file at `path` converts into a model the engine runs: read
    from its metadata before anything is converted."""
    import gguf

    reader = gguf.GGUFReader(str(path))

    def field(name: str):
        value = reader.fields.get(name)
        return None if value is None else value.parts[value.data[0]]

    raw = field("general.architecture")
    arch = bytes(raw).decode() if raw is not None else "?"
    experts = field(f"{arch}.expert_count")
    why = GGUF_NOT_CONVERTED.get(arch)
    if arch == "llama" and experts is not None and int(experts[0]) > 0:
        why = "a llama file with experts (Mixtral): transformers' GGUF reader reads no experts for llama"
    elif why is None and arch not in GGUF_ARCHITECTURES:
        why = "the engine does not run it"
    if why is not None:
        raise UnsupportedModel(
            f"GGUF architecture {arch!r} ({Path(path).name}) is not supported: {why}; supported as GGUF: "
            f"{', '.join(GGUF_ARCHITECTURES)}; as safetensors folders: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def check_folder_supported(folder: str | Path) -> None:
    """UnsupportedModel unless the engine runs the architecture of the model in `folder` (its config.json);
    UnsupportedQuantization unless it serves the checkpoint's quantization, if any."""
    config = json.loads((Path(folder) / "config.json").read_text())
    check_supported(config.get("model_type", "?"), config.get("architectures"))
    checkpoint_quantization(config)


@dataclass(slots=True)
class ModelInfo:
    model_type: str
    max_model_len: int
    eos_token_ids: list[int]
    vocab_size: int

    @classmethod
    def from_folder(cls, folder: str | Path, max_model_len: int | None = None) -> ModelInfo:
        folder = Path(folder)
        config = json.loads((folder / "config.json").read_text())
        context = config.get("max_position_embeddings") or config.get("n_positions") or config.get("n_ctx") or 2048
        if max_model_len is not None:
            if max_model_len > context:
                raise ValueError(f"--max-model-len {max_model_len} exceeds the model's context length {context}")
            context = max_model_len
        eos: list[int] = []
        generation = folder / "generation_config.json"
        sources = [config] + ([json.loads(generation.read_text())] if generation.is_file() else [])
        for source in sources:
            value = source.get("eos_token_id")
            for token in value if isinstance(value, list) else [value]:
                if token is not None and token not in eos:
                    eos.append(int(token))
        return cls(config["model_type"], int(context), eos, int(config["vocab_size"]))


# The sampling fields a model's generation_config.json may set as its defaults, as vLLM takes them (its
# --generation-config auto): a request that leaves one out gets the model's value instead of the API's.
GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(folder: str | Path) -> dict[str, float]:
    """The sampling defaults in `folder`'s generation_config.json: those of GENERATION_DEFAULT_FIELDS it sets to
    a number (none without the file)."""
    path = Path(folder) / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    return {
        name: config[name]
        for name in GENERATION_DEFAULT_FIELDS
        if isinstance(config.get(name), (int, float)) and not isinstance(config[name], bool)
    }


class TensorParallelError(ValueError):
    """The model cannot be split over this many tensor-parallel ranks."""


def shard_size(total: int, ranks: int, what: str) -> int:
    """Each rank's share of `total` heads or features; an error naming both numbers when it does not divide."""
    if total % ranks:
        raise TensorParallelError(f"--tensor-parallel-size {ranks} does not divide the model's {total} {what}")
    return total // ranks


def check_tensor_parallel(folder: str | Path, ranks: int) -> None:
    """Fail before any rank starts when the model's heads or MLP width do not split over `ranks` (each
    model checks its own again as it is built: gpu_worker/models/)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    if "n_head" in config:  # GPT-2
        sizes = {"attention heads": config["n_head"], "MLP features": config.get("n_inner") or 4 * config["n_embd"]}
    else:
        heads = config["num_attention_heads"]
        sizes = {
            "attention heads": heads,
            "KV heads": config.get("num_key_value_heads") or heads,
            "MLP features (intermediate_size)": config["intermediate_size"],
        }
        if config.get("moe_intermediate_size"):  # Qwen3-MoE's experts (Mixtral's use intermediate_size)
            sizes["expert MLP features (moe_intermediate_size)"] = config["moe_intermediate_size"]
    for what, total in sizes.items():
        shard_size(total, ranks, what)
