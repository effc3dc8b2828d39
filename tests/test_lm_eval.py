"""EleutherAI's lm-evaluation-harness against the server, on a small local task (tests/lm_eval_task):
`local-completions` scores a multiple-choice task (loglikelihood: token-id prompts, echo, logprobs=1) and
runs a generate_until task, `local-chat-completions` runs the generate_until task through the chat
template; the loglikelihoods equal those of the harness's own `hf` backend on the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")

DATA = Path(__file__).parent / "lm_eval_task" / "capitals.jsonl"
MODEL = "smollm2"
TOLERANCE = 0.02  # nats, the bound
PROMPT = "The capital of {{country}} is"

TASKS = {
    "clearserve_capitals_mc": """
output_type: multiple_choice
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
""",
    "clearserve_capitals_gen": """
output_type: generate_until
doc_to_target: " {{capital}}"
generation_kwargs: {until: ["\\n", "."], max_gen_toks: 8, do_sample: false, temperature: 0}
metric_list:
  - metric: exact_match
    ignore_case: true
    ignore_punctuation: true
""",
}


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory):
    """Our two tasks alone: the harness's built-in tasks (thousands of files) are not indexed."""
    from lm_eval.tasks import TaskManager

    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    for name, body in TASKS.items():
        head = (
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {DATA}\n"
            f'test_split: test\ndoc_to_text: "{PROMPT}"\n'
        )
        (folder / f"{name}.yaml").write_text(head + body)
    return TaskManager(include_path=str(folder), include_defaults=False)


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server


def evaluate(model, tasks: list[str], task_manager, **kwargs) -> dict:
    """`model`: a harness model name (with model_args=...) or a harness LM object."""
    return lm_eval.simple_evaluate(model=model, tasks=tasks, task_manager=task_manager, log_samples=True, **kwargs)


def loglikelihoods(results: dict) -> list[float]:
    samples = sorted(results["samples"]["clearserve_capitals_mc"], key=lambda s: s["doc_id"])
    return [float(resp[0][0]) for s in samples for resp in s["resps"]]


def test_local_completions_and_chat_completions_run_and_score_like_the_hf_backend(
    server, smollm2_folder, smollm2_hf_model, task_manager, monkeypatch
):
    from lm_eval.models.huggingface import HFLM

    # The results' environment report runs `pip list` and more in subprocesses at every evaluation; nothing
    # here reads it.
    monkeypatch.setattr("lm_eval.evaluator.add_env_info", lambda results: None)

    # Eight requests at a time: decoded in one batch, a step costs what one request's does (the float32 weights
    # are read once a step).
    common = f"model={MODEL},tokenizer={smollm2_folder},tokenizer_backend=huggingface,num_concurrent=8,max_retries=1"
    served = evaluate(
        "local-completions",
        ["clearserve_capitals_mc", "clearserve_capitals_gen"],
        task_manager,
        model_args=f"base_url={server.url}/v1/completions,{common}",
    )
    chat = evaluate(
        "local-chat-completions",
        ["clearserve_capitals_gen"],
        task_manager,
        model_args=f"base_url={server.url}/v1/chat/completions,{common}",
        apply_chat_template=True,
    )
    # The harness's `hf` backend on the session's float32 CPU copy of the weights (loaded once for every test).
    reference = evaluate(HFLM(pretrained=smollm2_hf_model), ["clearserve_capitals_mc"], task_manager)

    assert loglikelihoods(served) == pytest.approx(loglikelihoods(reference), abs=TOLERANCE)
    assert (
        served["results"]["clearserve_capitals_mc"]["acc,none"]
        == reference["results"]["clearserve_capitals_mc"]["acc,none"]
    )
    for results in (served, chat):
        generations = [s["resps"][0][0] for s in results["samples"]["clearserve_capitals_gen"]]
        assert len(generations) == 6 and any(generations), "the server generated answers"
        assert "exact_match,none" in results["results"]["clearserve_capitals_gen"]
