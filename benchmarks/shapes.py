"""Real model sizes without their weights: shape folders for `--load-format dummy` benchmarks.

    python -m benchmarks.shapes llama-3-8b OUT_FOLDER --tokenizer-from TOKENIZER_FOLDER

writes OUT_FOLDER/config.json (the shape's architecture, with the tokenizer's vocabulary size, so that every
token the engine samples can be detokenized) beside a copy of the tokenizer files of TOKENIZER_FOLDER (any
folder the project already has: GPT-2's, the embedded SmolLM2's). The layer sizes are the published models';
only the vocabulary differs, which moves the lm-head's share of a step (Llama-3's 128,256 rows against
SmolLM2's 49,152), and a benchmark says which tokenizer it ran with. Shapes: Llama-3.2-1B, Llama-3-8B,
Llama-3-70B, and two mixtures of experts, Qwen3-30B-A3B (128 experts, top-8) and Mixtral-8x7B (8, top-2).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

# The architecture fields of each shape (config.json's), as the published checkpoints set them.
_LLAMA3 = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
}
SHAPES: dict[str, dict] = {
    "llama-3.2-1b": {
        **_LLAMA3,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "tie_word_embeddings": True,
    },
    "llama-3-8b": {
        **_LLAMA3,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
    },
    "llama-3-70b": {
        **_LLAMA3,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
    },
    # Mixtures of experts: each token runs top-k of E experts, so a decode step reads the experts its batch picks.
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "hidden_size": 2048,
        "intermediate_size": 6144,  # the dense MLP's, unused: every layer is sparse
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
    },
    "mixtral-8x7b": {
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)


def write_shape(name: str, out: str | Path, tokenizer_from: str | Path) -> Path:
    """The shape folder `out` for `name`, its vocabulary and end-of-sequence ids the tokenizer folder's."""
    source, out = Path(tokenizer_from), Path(out)
    reference = json.loads((source / "config.json").read_text())
    config = {
        **SHAPES[name],
        "vocab_size": reference["vocab_size"],
        "bos_token_id": reference.get("bos_token_id"),
        "eos_token_id": reference.get("eos_token_id"),
        "torch_dtype": "bfloat16",
    }
    out.mkdir(parents=True, exist_ok=True)
    for file in TOKENIZER_FILES:
        if (source / file).is_file():
            shutil.copy(source / file, out / file)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", help="the folder to write")
    parser.add_argument("--tokenizer-from", required=True, help="a model folder whose tokenizer the shape uses")
    args = parser.parse_args(argv)
    print(write_shape(args.shape, args.out, args.tokenizer_from))


if __name__ == "__main__":
    main()
