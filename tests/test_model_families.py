"""Which architectures the engine runs, and the parts of the families that the token-exact tests
(test_correctness.py, test_tensor_parallel.py) do not isolate: a mixture-of-experts layer sums each token's
picked experts, experts load from either checkpoint layout, GGUF files of the families transformers' reader
converts, longrope's two tables, and every family served over HTTP: transformers' greedy tokens, the in-process
engine's text."""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from common.model_info import GGUF_ARCHITECTURES, SUPPORTED_MODEL_TYPES, UnsupportedModel, check_folder_supported
from common.sampling_params import SamplingParams
from gpu_worker.model_loader import load_model
from gpu_worker.models import MODEL_CLASSES
from gpu_worker.models.moe import SparseMoE
from gpu_worker.parallel import SINGLE
from offline import LLM
from tests.conftest import FAMILIES
from tests.server_process import ServerProcess
from tests.tiny_models import FAMILY_CONFIGS, build_gguf, build_model, hf_greedy, random_prompts


def test_the_launchers_list_is_the_model_code_we_have_and_every_entry_is_tested():
    assert set(MODEL_CLASSES) == set(SUPPORTED_MODEL_TYPES)
    assert set(SUPPORTED_MODEL_TYPES) == {"gpt2", "llama", *FAMILIES} == {"gpt2", "llama", *FAMILY_CONFIGS}


def test_an_architecture_without_model_code_is_named_with_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "falcon", "architectures": ["FalconForCausalLM"]}))
    with pytest.raises(UnsupportedModel) as raised:
        check_folder_supported(tmp_path)
    message = str(raised.value)
    assert "'falcon' (FalconForCausalLM) is not supported" in message
    assert all(model_type in message for model_type in SUPPORTED_MODEL_TYPES) and "\n" not in message


def moe_layer(renormalize: bool) -> SparseMoE:
    torch.manual_seed(0)
    moe = SparseMoE(32, 24, 6, 2, SINGLE, "silu", fused=False, renormalize=renormalize, weights_in_model_dtype=False)
    for param in moe.parameters():
        torch.nn.init.normal_(param, std=0.3)
    return moe


@pytest.mark.parametrize("renormalize", [True, False])
def test_the_experts_sum_each_tokens_picked_experts_by_their_weights(renormalize):
    """The torch path, which runs each expert on its own tokens, against each token's experts run one by one
    (the fused kernels are checked against it: test_fused_moe.py)."""
    moe = moe_layer(renormalize)
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(1))
    ids, weights = moe.route(x)
    assert ids.unique().numel() > 2, "several experts are picked"
    routed = moe.experts(x, ids, weights)
    by_hand = torch.stack(
        [sum(w * moe.experts._expert(int(e), x[t : t + 1])[0] for e, w in zip(ids[t], weights[t])) for t in range(9)]
    )
    torch.testing.assert_close(routed, by_hand, rtol=1e-6, atol=1e-6)


def test_router_weights_sum_to_one_only_when_renormalized():
    x = torch.randn(5, 32)
    assert torch.allclose(moe_layer(True).route(x)[1].sum(-1), torch.ones(5))
    assert (moe_layer(False).route(x)[1].sum(-1) < 1).all()


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_experts_load_from_one_tensor_each_or_stacked(family, tmp_path):
    """Hub checkpoints store one tensor per expert; transformers 5's own state dict (which the GGUF conversion
    saves, common/model_source.py) stacks them: both give the same model."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    per_expert = build_model(family, tmp_path / "per-expert")
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    state = AutoModelForCausalLM.from_pretrained(per_expert, dtype=torch.float32).state_dict()
    assert any(name.endswith("experts.gate_up_proj") for name in state)
    save_file({k: v.contiguous() for k, v in state.items()}, stacked / "model.safetensors")
    (stacked / "config.json").write_text((per_expert / "config.json").read_text())
    ours = [
        dict(load_model(str(f), "auto", torch.float32, torch.device("cpu")).named_parameters())
        for f in (per_expert, stacked)
    ]
    assert ours[0].keys() == ours[1].keys()
    assert all(torch.equal(ours[0][name], ours[1][name]) for name in ours[0])


# Each family llama.cpp writes and transformers 5.24's GGUF reader converts, with what the reader keeps of its
# config. A field the reader does not map (the README's "Supported models" lists them) takes transformers' config
# default, so the tiny model sets it to that default: Gemma's soft-caps and query_pre_attn_scalar, Gemma 3's layer
# pattern (5 sliding, 1 global) and unscaled RoPE, Phi-3's window, longrope and full rotary. Qwen3: head_dim 128
# and no q/k/v bias (the reader's qwen3 has no key_length, the architecture no bias).
GGUF_CASES: dict[str, dict] = {
    "gpt2": dict(n_positions=1024),  # the reader sets n_ctx from the file, n_positions stays 1024
    "llama": dict(),
    "qwen2": dict(),
    "qwen3": dict(head_dim=128, attention_bias=False),
    "phi3": dict(sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}),
    "gemma2": dict(query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma3_text": dict(
        query_pre_attn_scalar=256,
        num_hidden_layers=6,
        layer_types=None,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        },
    ),
}


def test_every_gguf_architecture_is_tested():
    assert set(GGUF_ARCHITECTURES.values()) == set(GGUF_CASES)


@pytest.mark.parametrize("family", GGUF_CASES)
def test_a_gguf_file_runs_token_for_token_as_its_safetensors(family, tmp_path, monkeypatch):
    """The family as llama.cpp writes it, converted once by transformers' GGUF reader (common/model_source.py): our
    tokens from the converted folder are transformers' from the original one."""
    from common.model_source import resolve_model

    monkeypatch.setenv("CLEARSERVE_CACHE", str(tmp_path / "cache"))
    source = build_model(family, tmp_path / family, **GGUF_CASES[family])
    converted = resolve_model(str(build_gguf(source, tmp_path / f"{family}.gguf")))
    assert json.loads((converted / "config.json").read_text())["model_type"] == family
    prompts = random_prompts(3, [5, 20, 40], vocab=512, seed=4)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with LLM(str(converted), device="cpu", dtype="float32", num_kv_blocks=64) as llm:
        ours = [o.token_ids for o in llm.generate(prompts, params)]
    assert ours == hf_greedy(source, prompts, 16)


def test_longrope_turns_positions_past_the_original_length_by_the_long_factors(tmp_path):
    """Phi-3's longrope: our table's rows below original_max_position_embeddings are transformers' short-factor
    rotation, the later ones its long-factor one (models/rotary.py says where the two differ)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from gpu_worker.models.rotary import RotaryEmbedding

    folder = build_model("phi3", tmp_path / "phi3", original_max_position_embeddings=64)
    config = AutoConfig.from_pretrained(folder)
    reference = AutoModelForCausalLM.from_pretrained(folder).model.rotary_emb
    ours = RotaryEmbedding(config)
    assert ours.rotary_dim == 8  # partial_rotary_factor 0.5 of 16
    for position in (0, 63, 64, 300):
        cos, sin = reference(torch.zeros(1), torch.tensor([[position]]))
        assert torch.equal(cos[0, 0], ours.cos[position]) and torch.equal(sin[0, 0], ours.sin[position])
    short = 64 * reference.original_inv_freq
    assert not torch.allclose(torch.cat((short, short)).cos() * reference.attention_scaling, ours.cos[64])


PROMPTS = ["def main():", "import json\n", "The quick", "class Foo"]


@pytest.fixture(scope="module", params=FAMILIES)
def family_server(request, tmp_path_factory):
    """One server per family (tests/tiny_models.py FAMILY_CONFIGS: sliding windows, soft-caps, norms, experts)."""
    folder = build_model(request.param, tmp_path_factory.mktemp(request.param))
    log = tmp_path_factory.mktemp("log") / "server.log"
    server = ServerProcess(
        folder, "--num-kv-blocks", "64", "--dtype", "float32", "--tokenizer-workers", "1", log_path=log
    )
    yield folder, server
    server.stop(signal.SIGTERM)


def test_a_served_family_answers_what_the_engine_computes_in_process(family_server):
    folder, server = family_server
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with LLM(str(folder), device="cpu", dtype="float32", num_kv_blocks=64) as llm:
        expected = [o.text for o in llm.generate(PROMPTS, params)]
    with server.client() as client:
        got = []
        for prompt in PROMPTS:
            body = {"prompt": prompt, "max_tokens": 40, "temperature": 0.0, "ignore_eos": True}
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            got.append(response.json()["choices"][0]["text"])
    assert got == expected and all(got)


def test_a_served_family_gives_transformers_greedy_tokens(family_server):
    """Token ids in, token ids out (POST /generate), the prompts sent at once so that they share steps; the
    longer prompts and their new tokens go past the sliding windows (tests/tiny_models.py: TINY_WINDOW)."""
    folder, server = family_server
    prompts = random_prompts(4, [5, 17, 35, 50], vocab=512, seed=6)
    sampling = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    with server.client() as client, ThreadPoolExecutor(len(prompts)) as pool:

        def generate(prompt: list[int]) -> list[int]:
            response = client.post("/generate", json={"input_ids": prompt, "sampling_params": sampling})
            assert response.status_code == 200, response.text
            return response.json()["token_ids"]

        served = list(pool.map(generate, prompts))
    assert served == hf_greedy(folder, prompts, 24)
