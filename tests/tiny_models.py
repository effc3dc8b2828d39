"""Tiny random models built on the spot: a byte-level BPE trained on a few local files, and checkpoints of
every model family the engine runs, saved the way Hugging Face saves them. Nothing is downloaded."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Multi-byte text in the corpus so that merges join bytes of CJK characters and emoji: the streaming
# tests then see tokens that end in the middle of a character.
MULTIBYTE_LINES = [
    "你好，世界。今天天气很好。",
    "日本語のテキストです。",
    "emoji 🚀🔥✨ and ñandú café",
    "한국어 문장입니다",
]


def build_tokenizer(folder: Path, vocab_size: int = 512) -> None:
    _trained_tokenizer(vocab_size).save_pretrained(folder)


@functools.cache
def _trained_tokenizer(vocab_size: int):
    """Trained once per process (a second of CPU each time), then saved into every folder that needs it."""
    import json as json_module
    import textwrap as textwrap_module

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = [json_module.__file__, textwrap_module.__file__, os.__file__]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [Path(f).read_text() for f in files] + MULTIBYTE_LINES * 20
    tokenizer.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", bos_token="<|endoftext|>", unk_token="<|endoftext|>"
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


# Every family's tiny shape: 4 query heads of 16 in 2 KV heads, a 64-wide residual stream.
TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    initializer_range=0.2,
    tie_word_embeddings=False,
    eos_token_id=0,
    bos_token_id=0,
    pad_token_id=0,
)
# A window that the test prompts (up to 50 tokens) and their 32 new tokens go well past.
TINY_WINDOW = 24

# Each new family's tiny config, beyond TINY_SHAPE: every feature that sets it apart from Llama switched on,
# with sizes that make a mistake in it change the greedy tokens (small soft-caps, short windows).
FAMILY_CONFIGS: dict[str, dict] = {
    "mistral": dict(sliding_window=TINY_WINDOW),
    "qwen2": dict(),  # q/k/v biases (random, as every family's here)
    "qwen3": dict(attention_bias=True),
    "gemma2": dict(
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=24,
        sliding_window=TINY_WINDOW,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=10.0,
        tie_word_embeddings=True,
    ),
    "gemma3_text": dict(
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=24,
        sliding_window=TINY_WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
        },
        tie_word_embeddings=True,
    ),
    # longrope with its attention scaling (512 / 128 positions); 16-dim heads, half of each rotated (4 frequencies).
    # The test sequences stay within the original 128 positions, where transformers uses the short factors
    # throughout (past them it recomputes the whole sequence with the long ones: models/rotary.py).
    "phi3": dict(
        sliding_window=40,
        original_max_position_embeddings=128,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10_000.0,
            "partial_rotary_factor": 0.5,
            "factor": 4.0,
            "short_factor": [1.0, 1.3, 1.7, 2.0],
            "long_factor": [2.0, 3.0, 5.0, 8.0],
        },
    ),
    "olmo2": dict(),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
    # Three layers: experts, dense (mlp_only_layers), experts; top-k weights not renormalized (norm_topk_prob off).
    "qwen3_moe": dict(
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=False,
        mlp_only_layers=[1],
    ),
}


def build_model(kind: str, folder: Path, seed: int = 0, **overrides) -> Path:
    """Save a random `kind` model ('gpt2', 'llama', or a FAMILY_CONFIGS model_type) with a fresh tokenizer into
    `folder`. The new families' norm weights and biases are random too (away from their init of 1, or 0 for
    Gemma's (1 + w)), so that a norm applied in the wrong style changes the outputs."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
    )

    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer(folder)
    vocab = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"])
    torch.manual_seed(seed)
    # A larger init than usual keeps logits well apart, so float32 rounding cannot flip an argmax.
    if kind == "gpt2":
        gpt2 = dict(
            vocab_size=vocab,
            n_positions=512,
            n_embd=64,
            n_layer=2,
            n_head=4,
            initializer_range=0.2,
            eos_token_id=0,
            bos_token_id=0,
        )
        config = GPT2Config(**{**gpt2, **overrides})
        model = GPT2LMHeadModel(config)
    elif kind == "llama":
        llama = dict(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            initializer_range=0.2,
            tie_word_embeddings=False,
            eos_token_id=0,
            bos_token_id=0,
        )
        config = LlamaConfig(**{**llama, **overrides})
        model = LlamaForCausalLM(config)
    elif kind in FAMILY_CONFIGS:
        settings = {**TINY_SHAPE, "vocab_size": vocab, **FAMILY_CONFIGS[kind], **overrides}
        config = AutoConfig.for_model(kind, **settings)
        model = AutoModelForCausalLM.from_config(config)
        _randomize_norms_and_biases(model, seed)
    else:
        raise ValueError(kind)
    model.save_pretrained(folder)
    return folder


def _randomize_norms_and_biases(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(torch.randn(param.shape, generator=gen) * 0.3)


def build_scripted_model(folder: Path, chain: list[int]) -> Path:
    """A one-layer Llama whose greedy output is scripted: after token chain[i] it emits chain[i + 1],
    after the last one EOS (0). Attention and MLP outputs are zeroed and the embedding is the identity,
    so the logits are lm_head's column for the current token. Lets a test choose the exact output ids
    (and so the exact token boundaries inside multi-byte characters)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer(folder)
    vocab = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"])
    if len(set(chain)) != len(chain) or 0 in chain:
        raise ValueError("a chain must not repeat a token or contain EOS (0)")
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=vocab,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=0,
        bos_token_id=0,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(vocab))
        model.model.norm.weight.fill_(1.0)
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        for current, following in zip(chain, chain[1:] + [0]):
            model.lm_head.weight[following, current] = 1.0
    model.save_pretrained(folder)
    return folder


def hf_greedy(folder: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference: Hugging Face generate, one prompt at a time, float32 on CPU, EOS ignored."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                min_new_tokens=max_new_tokens,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def hf_greedy_choices(model, prompts: list[list[int]], continuations: list[list[int]]) -> list[list[int]]:
    """Reference, teacher-forced: a Hugging Face model's argmax after each prefix prompt + continuation[:i],
    from one forward per prompt. It equals `continuation` exactly when greedy generation from the prompt
    produces `continuation`: the same check as hf_greedy, without a forward per generated token."""
    choices = []
    with torch.inference_mode():
        for prompt, continuation in zip(prompts, continuations):
            ids = torch.tensor([prompt + continuation[:-1]])
            logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0]
            choices.append(logits[len(prompt) - 1 :].argmax(dim=-1).tolist())
    return choices


def random_prompts(count: int, lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Token 0 is EOS in the tiny models: keep it out of prompts.
    return [torch.randint(1, vocab, (lengths[i % len(lengths)],), generator=gen).tolist() for i in range(count)]


__all__ = [
    "FAMILY_CONFIGS",
    "build_gguf",
    "build_model",
    "build_tokenizer",
    "hf_greedy",
    "hf_greedy_choices",
    "random_prompts",
]


def build_gguf(folder: Path, path: Path) -> Path:
    """Write `folder`'s model (build_model's, of a family in common/model_info.py GGUF_ARCHITECTURES, or Qwen3-MoE,
    whose file transformers does not convert) as a float32 GGUF file the way llama.cpp lays one out: its metadata
    keys, its tensor names (experts stacked per layer), Llama's q and k rows in its rotary order, Gemma's norms
    stored as 1 + w, GPT-2's Conv1D weights transposed, the byte-level BPE as a "gpt2" tokenizer."""
    import re

    import gguf
    from safetensors.torch import load_file

    from common.model_info import GGUF_ARCHITECTURES

    config = json.loads((folder / "config.json").read_text())
    if config["model_type"] == "gpt2":  # its own names for the shared sizes
        width = config["n_embd"]
        config |= dict(
            max_position_embeddings=config["n_positions"],
            hidden_size=width,
            num_hidden_layers=config["n_layer"],
            intermediate_size=config["n_inner"] or 4 * width,
            num_attention_heads=config["n_head"],
            num_key_value_heads=config["n_head"],
            head_dim=width // config["n_head"],
        )
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    llama_cpp_names = {model_type: arch for arch, model_type in GGUF_ARCHITECTURES.items()} | {"qwen3_moe": "qwen3moe"}
    arch = llama_cpp_names[config["model_type"]]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    if rope := config.get("rope_parameters"):
        writer.add_rope_dimension_count(config["head_dim"])
        writer.add_rope_freq_base((rope.get("full_attention") or rope)["rope_theta"])
    if arch == "gpt2":
        writer.add_layer_norm_eps(config["layer_norm_epsilon"])
    else:
        writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("sliding_window"):
        writer.add_sliding_window(config["sliding_window"])
    if arch == "qwen3moe":
        writer.add_expert_count(config.get("num_experts") or config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    vocab = sorted(tokenizer["model"]["vocab"], key=tokenizer["model"]["vocab"].get)
    special = {t["content"] for t in tokenizer["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(vocab)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in vocab])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_pad_token_id(0)  # else Phi-3's config default (32000) lands outside the tiny vocabulary
    tensors = load_file(folder / "model.safetensors")
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name in list(tensors):
        if match := re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight", name):
            experts.setdefault(f"{match[1]}.{match[3]}", {})[int(match[2])] = tensors.pop(name)
    for name, by_index in experts.items():
        tensors[name] = torch.stack([by_index[i] for i in sorted(by_index)])
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for name, tensor in tensors.items():
        projection = name.split(".")[-2]
        if arch == "llama" and projection in heads:  # each head's rows as (pairs, 2), stored as (2, pairs)
            n = heads[projection]
            tensor = tensor.reshape(n, 2, -1, tensor.shape[-1]).transpose(1, 2).reshape(tensor.shape)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            tensor = tensor + 1
        if arch == "gpt2" and projection in ("c_attn", "c_proj", "c_fc") and name.endswith(".weight"):
            tensor = tensor.T  # Conv1D's [in, out], stored as a linear layer's [out, in]
        tensors[name] = tensor
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config["num_hidden_layers"])
    for name, tensor in tensors.items():
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def prefill_logits(
    model: torch.nn.Module,
    lengths: list[int],
    block_tables: list[list[int]],
    block_size: int,
    kv_dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """The logits of one prefill step of len(lengths) sequences of random ids (seeded), each in its blocks, on
    the torch attention: a model's forward with nothing but its own layers' kernels in question."""
    import numpy as np

    from gpu_worker.attention import BatchLayout, TorchAttention
    from gpu_worker.kv_cache import PagedKVCache
    from gpu_worker.models.forward_context import ForwardContext

    layout = BatchLayout.build(lengths, lengths, block_tables, block_size)
    positions = np.concatenate([np.arange(n) for n in lengths])
    ids = torch.randint(1, 500, (sum(lengths),), generator=torch.Generator().manual_seed(8)).to(device)
    layers, kv_heads, head_dim = model.kv_shape
    num_blocks = 1 + max(block for table in block_tables for block in table)
    cache = PagedKVCache(layers, num_blocks, block_size, kv_heads, head_dim, kv_dtype, device)
    attention = TorchAttention(block_size)
    metadata = attention.build_metadata(
        layout,
        layout.slot_mapping(positions, block_size),
        lambda v, dtype: torch.as_tensor(v, dtype=dtype, device=device),
    )
    with torch.inference_mode():
        hidden = model(ids, torch.as_tensor(positions, device=device), ForwardContext(attention, metadata, cache))
        return model.compute_logits(hidden)
