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
def task_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    for name, body in TASKS.items():
        head = (
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {DATA}\n"
            f'test_split: test\ndoc_to_text: "{PROMPT}"\n'
        )
        (folder / f"{name}.yaml").write_text(head + body)
    return folder


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server


def evaluate(model: str, model_args: str, tasks: list[str], task_dir: Path, **kwargs) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        task_manager=TaskManager(include_path=str(task_dir)),
        log_samples=True,
        **kwargs,
    )


def loglikelihoods(results: dict) -> list[float]:
    samples = sorted(results["samples"]["clearserve_capitals_mc"], key=lambda s: s["doc_id"])
    return [float(resp[0][0]) for s in samples for resp in s["resps"]]


def test_local_completions_and_chat_completions_run_and_score_like_the_hf_backend(server, smollm2_folder, task_dir):
    common = f"model={MODEL},tokenizer={smollm2_folder},tokenizer_backend=huggingface,num_concurrent=2,max_retries=1"
    served = evaluate(
        "local-completions",
        f"base_url={server.url}/v1/completions,{common}",
        ["clearserve_capitals_mc", "clearserve_capitals_gen"],
        task_dir,
    )
    chat = evaluate(
        "local-chat-completions",
        f"base_url={server.url}/v1/chat/completions,{common}",
        ["clearserve_capitals_gen"],
        task_dir,
        apply_chat_template=True,
    )
    reference = evaluate(
        "hf", f"pretrained={smollm2_folder},dtype=float32,device=cpu", ["clearserve_capitals_mc"], task_dir
    )

    assert loglikelihoods(served) == pytest.approx(loglikelihoods(reference), abs=TOLERANCE)
    assert (
        served["results"]["clearserve_capitals_mc"]["acc,none"]
        == reference["results"]["clearserve_capitals_mc"]["acc,none"]
    )
    for results in (served, chat):
        generations = [s["resps"][0][0] for s in results["samples"]["clearserve_capitals_gen"]]
        assert len(generations) == 6 and any(generations), "the server generated answers"
        assert "exact_match,none" in results["results"]["clearserve_capitals_gen"]
