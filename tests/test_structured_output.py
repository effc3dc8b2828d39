"""Structured output through the engine (scheduler grammar, device mask): whatever a random model would
say, the output follows the grammar, and ends when the grammar is complete. How grammars are compiled (off the
scheduler's loop, bounded): tests/test_grammar_compile.py."""

from __future__ import annotations

import json
import re

import pytest

from common.sampling_params import InvalidParameter, SamplingParams, StructuredOutput
from offline import LLM
from tests.tiny_models import random_prompts

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["id", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with LLM(str(tiny_llama), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64) as llm:
        yield llm


def texts(llm: LLM, structured: StructuredOutput, count: int = 4, max_tokens: int = 60) -> list:
    prompts = random_prompts(count, [5, 9, 7, 12], vocab=512, seed=21)
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, structured=structured) for i in range(count)
    ]
    outs = llm.generate(prompts, params, on_step=llm.scheduler.check_integrity)
    for out in outs:
        out.text = llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    return outs


def test_regex_output_matches_the_pattern(llm):
    for out in texts(llm, StructuredOutput("regex", "[a-c]{2,4}-[0-9]{3}")):
        assert re.fullmatch("[a-c]{2,4}-[0-9]{3}", out.text), out.text
        assert out.finish_reason == "stop"


def test_choice_output_is_one_of_the_choices(llm):
    for out in texts(llm, StructuredOutput("choice", json.dumps(["red", "green blue"]))):
        assert out.text in ("red", "green blue") and out.finish_reason == "stop"


def test_grammar_output_is_a_sentence_of_the_grammar(llm):
    grammar = 'root ::= ("yes" | "no") "-" [0-9] [0-9]'  # EBNF, xgrammar's dialect
    for out in texts(llm, StructuredOutput("grammar", grammar)):
        assert re.fullmatch("(yes|no)-[0-9]{2}", out.text), out.text
        assert out.finish_reason == "stop"


def test_json_schema_output_parses_and_follows_the_schema(llm):
    for out in texts(llm, StructuredOutput("json", json.dumps(SCHEMA)), max_tokens=100):
        value = json.loads(out.text)
        assert set(value) == {"id", "ok"} and isinstance(value["id"], int) and isinstance(value["ok"], bool)


def test_structured_and_free_requests_share_a_batch(llm):
    prompts = random_prompts(2, [6, 8], vocab=512, seed=22)
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ruled = SamplingParams(max_tokens=12, temperature=0.0, structured=StructuredOutput("regex", "x{5}"))
    both = llm.generate(prompts, [free, ruled])
    assert both[0].token_ids == llm.generate(prompts[:1], free)[0].token_ids, "the free one is unaffected"
    assert llm.tokenizer.decode(both[1].token_ids, skip_special_tokens=True) == "xxxxx"


@pytest.mark.parametrize(
    "structured",
    [
        StructuredOutput("regex", "(unclosed", "guided_regex"),
        StructuredOutput("grammar", "root ::= (", "structured_outputs"),
    ],
)
def test_a_grammar_that_does_not_compile_is_refused_naming_its_field(llm, structured):
    with pytest.raises(InvalidParameter) as refused:
        llm.add_request([5, 6], SamplingParams(structured=structured))
    assert refused.value.field == structured.field


def test_a_grammar_past_max_grammar_bytes_is_refused_naming_its_field(llm):
    too_big = StructuredOutput("regex", "a" * (llm.config.max_grammar_bytes + 1), "guided_regex")
    with pytest.raises(InvalidParameter, match="--max-grammar-bytes") as refused:
        llm.add_request([5, 6], SamplingParams(structured=too_big))
    assert refused.value.field == "guided_regex"
