"""benchmarks.host_steps.HostStepLog: a record of each pass of LLM.generate's loop, for benchmarks.offline's host
figures, kept by an observer the benchmark hands to generate."""

from __future__ import annotations

from benchmarks.host_steps import HostStepLog
from common.sampling_params import SamplingParams
from offline import LLM
from tests.tiny_models import random_prompts


def test_the_log_holds_every_planned_step_and_marks_the_decode_only_ones(tiny_gpt2):
    prompts = random_prompts(4, [5, 9, 17, 30], vocab=512, seed=3)
    llm = LLM(str(tiny_gpt2), max_num_seqs=4)
    log = HostStepLog()
    llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), observer=log)
    stats = llm.scheduler.stats
    planned = [t for t in log.passes if t.planned_rids]
    assert len(planned) == stats.steps
    assert sum(t.planned_tokens for t in planned) == stats.prompt_tokens_computed + stats.decode_tokens_computed
    decode_only = [t for t in planned if t.planned_tokens == t.planned_rids]
    assert decode_only and max(t.planned_rids for t in decode_only) == 4  # the steady state: every request decodes
    for t in log.passes:
        parts = (t.schedule_s, t.wire_s, t.prepare_s, t.forward_s, t.finish_s, t.process_s)
        assert min(parts) >= 0 and t.total_s >= t.schedule_s + t.wire_s + t.process_s
    assert log.full_decode_host_ms()["batch"] == 4


def test_the_host_time_per_step_is_spread_over_every_step_finished(tiny_gpt2):
    llm = LLM(str(tiny_gpt2))
    log = HostStepLog()
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), observer=log)
    assert sum(t.finished for t in log.passes) == llm.scheduler.stats.steps  # on a CPU each pass finishes its step
    assert log.host_ms_per_step() > 0
