"""benchmarks.tokenizer_memory plays the soak's requests through a tokenizer worker in-process: between
requests the worker tracks none, and a router with one replica to route to remembers no prefixes."""

from __future__ import annotations

from benchmarks.tokenizer_memory import main


def test_the_worker_tracks_no_request_and_one_replica_remembers_no_prefix_after_each_sample(tiny_llama):
    samples = main(["--model", str(tiny_llama), "--requests", "200", "--every", "50"])
    assert [s["requests"] for s in samples] == [0, 50, 100, 150, 200]
    assert all(s["tracked"] == 0 and s["remembered_blocks"] == 0 for s in samples)


def test_a_router_with_replicas_to_choose_among_remembers_the_prompts_prefixes(tiny_llama):
    samples = main(["--model", str(tiny_llama), "--requests", "50", "--every", "50", "--replicas", "2"])
    assert samples[-1]["tracked"] == 0
    assert samples[-1]["remembered_blocks"] > 0
