"""The engine on a CUDA device: float32 token-exact against transformers on the same device, and bf16
(the serving dtype) agreeing with transformers' bf16 on most tokens; every model family through the Triton
kernels, CUDA graphs and fused ops. Skipped where there is no GPU."""

from __future__ import annotations

import pytest
import torch

from common.sampling_params import SamplingParams
from offline import LLM
from tests.tiny_models import random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPT_LENGTHS = [5, 13, 17, 23, 31, 35, 47, 50]
# Room for these tests' batches and no more: the defaults on a GPU (hundreds of seats, a prompt budget of
# thousands) would capture dozens of graph buckets per engine, and a test starts several engines.
SMALL = dict(max_num_seqs=8, max_num_batched_tokens=512)


def hf_greedy_on(folder, prompts, new_tokens, dtype) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).cuda().eval()
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device="cuda")
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_float32_on_cuda_matches_transformers(tiny_model, backend):
    if backend == "triton":
        pytest.importorskip("triton", reason="the triton backend needs triton")
    prompts = random_prompts(8, PROMPT_LENGTHS, vocab=512)
    with LLM(str(tiny_model), device="cuda", dtype="float32", attention_backend=backend, **SMALL) as llm:
        params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        ours = [o.token_ids for o in llm.generate(prompts, params)]
    torch.backends.cuda.matmul.allow_tf32 = False
    assert ours == hf_greedy_on(tiny_model, prompts, 32, torch.float32)


def test_every_family_in_float32_on_cuda_matches_transformers(tiny_family):
    """The Triton backend: sliding windows and soft-caps in the attention kernels, every norm style, partial
    rotary and GeGLU in the fused ops, decode and mixed steps replayed from CUDA graphs (MoE: the fused experts)."""
    prompts = random_prompts(8, PROMPT_LENGTHS, vocab=512)
    with LLM(str(tiny_family), device="cuda", dtype="float32", attention_backend="triton", **SMALL) as llm:
        assert llm.runner.graphs is not None
        params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        ours = [o.token_ids for o in llm.generate(prompts, params)]
    torch.backends.cuda.matmul.allow_tf32 = False
    assert ours == hf_greedy_on(tiny_family, prompts, 32, torch.float32)


def test_bfloat16_on_cuda_mostly_agrees_with_transformers(tiny_model):
    prompts = random_prompts(8, PROMPT_LENGTHS, vocab=512)
    with LLM(str(tiny_model), device="cuda", dtype="bfloat16", **SMALL) as llm:
        ours = [
            o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        ]
    theirs = hf_greedy_on(tiny_model, prompts, 16, torch.bfloat16)
    # bf16 rounding differs between kernels, and a single flipped token changes the rest of a sequence:
    # compare the first tokens, where both start from the same context.
    first_agree = sum(a[0] == b[0] for a, b in zip(ours, theirs))
    assert first_agree >= 6, (ours, theirs)


def test_cuda_graph_decode_gives_the_same_tokens_as_eager(tiny_model):
    prompts = random_prompts(5, PROMPT_LENGTHS, vocab=512, seed=2)  # 5 sequences: replayed padded to 8
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM(str(tiny_model), device="cuda", dtype="float32", **SMALL) as graphs:
        assert graphs.runner.graphs is not None
        replayed = [o.token_ids for o in graphs.generate(prompts, params)]
    with LLM(str(tiny_model), device="cuda", dtype="float32", enforce_eager=True, **SMALL) as eager:
        assert eager.runner.graphs is None
        assert replayed == [o.token_ids for o in eager.generate(prompts, params)]


def test_cuda_graph_decode_samples_as_eager_whatever_the_rows_ask(tiny_model):
    """The decode graph draws greedy tokens itself; rows that sample at a temperature, ask for logprobs or a
    penalty draw outside it. Beside each other, and once only greedy rows are left, both give eager's tokens."""
    prompts = random_prompts(6, PROMPT_LENGTHS, vocab=512, seed=4)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    params = [
        greedy,
        SamplingParams(max_tokens=8, temperature=0.8, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        greedy,
        greedy,
    ]
    with LLM(str(tiny_model), device="cuda", dtype="float32", **SMALL) as graphs:
        replayed = graphs.generate(prompts, params)
    with LLM(str(tiny_model), device="cuda", dtype="float32", enforce_eager=True, **SMALL) as eager:
        expected = eager.generate(prompts, params)
    assert [o.token_ids for o in replayed] == [o.token_ids for o in expected]
    assert replayed[2].logprobs.token_ids == expected[2].logprobs.token_ids
    torch.testing.assert_close(replayed[2].logprobs.logprobs, expected[2].logprobs.logprobs, rtol=1e-4, atol=1e-4)


def staggered_run(llm: LLM, params: SamplingParams) -> list[list[int]]:
    """Prompts of many lengths arriving 1-3 at a time in front of a growing decode batch, some chunked."""
    lengths = iter([3, 300, 5, 9, 70, 17, 2, 33, 129, 4, 64, 400])
    rids: list[int] = []
    outputs: dict[int, list[int]] = {}

    def step() -> None:
        batch = llm.step()
        for rid, token in zip(batch.rids, batch.token_ids) if batch is not None else ():
            outputs.setdefault(rid, []).append(token)

    for arrivals in (1, 2, 3, 1, 2, 3):
        for prompt in random_prompts(arrivals, [next(lengths) for _ in range(arrivals)], vocab=512, seed=arrivals):
            rids.append(llm.add_request(prompt, params))
        for _ in range(3):
            step()
    while llm.scheduler.has_unfinished():
        step()
    return [outputs[rid] for rid in rids]


def test_steps_computing_prompts_replay_graphs_and_give_the_same_tokens_as_eager(tiny_model, monkeypatch):
    from gpu_worker.mixed_graphs import MixedGraphs

    replays = []
    real_run = MixedGraphs.run
    monkeypatch.setattr(
        MixedGraphs, "run", lambda self, inputs: replays.append(len(inputs.input_ids)) or real_run(self, inputs)
    )
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    config = dict(device="cuda", dtype="float32", max_num_seqs=8, max_num_batched_tokens=128)
    with LLM(str(tiny_model), **config) as graphs:
        ours = staggered_run(graphs, params)
    assert len(replays) >= 6 and max(replays) > 100  # prefill alone and beside decodes, chunks of 128 tokens
    with LLM(str(tiny_model), enforce_eager=True, **config) as eager:
        assert eager.runner.graphs is None
        assert ours == staggered_run(eager, params)


def test_every_family_replays_graphs_as_it_runs_eagerly(tiny_family):
    """A mixture of experts runs the same fused experts inside a graph as eagerly: same tokens."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    config = dict(device="cuda", dtype="float32", max_num_seqs=8, max_num_batched_tokens=128)
    with LLM(str(tiny_family), **config) as graphs:
        ours = staggered_run(graphs, params)
    with LLM(str(tiny_family), enforce_eager=True, **config) as eager:
        assert ours == staggered_run(eager, params)


def test_no_step_after_warm_up_compiles_a_kernel(tiny_model, monkeypatch):
    # A compile stalls every running request for a few hundred milliseconds: warm-up must have built
    # every kernel variant that serving can ask for, whatever the mix of prefills and decodes.
    triton = pytest.importorskip("triton", reason="the triton backend needs triton")
    if not hasattr(getattr(triton, "knobs", None), "runtime"):
        pytest.skip(f"Triton {triton.__version__} has no compile hook to observe")
    with LLM(str(tiny_model), device="cuda", dtype="bfloat16", attention_backend="triton", max_num_seqs=8) as llm:
        compiled: list[str] = []
        monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", lambda *, repr, **_: compiled.append(repr))
        staggered_run(llm, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    assert compiled == []
