"""Workload generators of the benchmarks: seeded and reproducible, lengths in range, repeats cycled,
unique prompts distinct, arrival schedules as asked."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from benchmarks.workloads import (
    load_prompts_file,
    parse_range,
    parse_repeats,
    poisson_gaps,
    random_lengths,
    random_token_prompts,
    repeated_text_prompts,
    send_offsets,
)


def test_parse_range_reads_low_high_or_one_value():
    assert parse_range("64-512") == (64, 512)
    assert parse_range("128") == (128, 128)
    with pytest.raises(ValueError):
        parse_range("9-3")


def test_random_token_prompts_are_reproducible_from_the_seed():
    assert random_token_prompts(20, (5, 50), 1000, seed=3) == random_token_prompts(20, (5, 50), 1000, seed=3)
    assert random_token_prompts(20, (5, 50), 1000, seed=3) != random_token_prompts(20, (5, 50), 1000, seed=4)


def test_random_token_prompts_have_lengths_in_range_and_ids_in_the_vocabulary():
    prompts = random_token_prompts(200, (5, 9), 50, seed=0, avoid=frozenset({0, 1}))
    assert all(5 <= len(p) <= 9 for p in prompts)
    assert {len(p) for p in prompts} == set(range(5, 10))  # 200 draws hit every length
    assert all(0 < t < 50 and t != 1 for p in prompts for t in p)


def test_random_lengths_are_reproducible_and_in_range():
    lengths = random_lengths(500, (16, 128), seed=7)
    assert lengths == random_lengths(500, (16, 128), seed=7)
    assert min(lengths) >= 16 and max(lengths) <= 128


def test_parse_repeats_reads_a_list_and_counts_up_ranges():
    assert parse_repeats("1,1,1,64") == [1, 1, 1, 64]
    assert parse_repeats("900-903") == [900, 901, 902, 903]
    assert parse_repeats("2, 5-6") == [2, 5, 6]


def test_repeats_are_cycled_over_requests():
    prompts = repeated_text_prompts("ab", [1, 1, 1, 3], num=9)
    assert prompts == ["ab", "ab", "ab", "ababab", "ab", "ab", "ab", "ababab", "ab"]


def test_unique_prompts_are_distinct_from_their_first_characters():
    prompts = repeated_text_prompts("Hello", [1, 4], num=50, unique=True)
    assert len(set(prompts)) == 50
    assert len({p[:3] for p in prompts[:10]}) == 10  # differ at the start, so no KV block can be shared
    assert prompts[1].endswith("Hello" * 4)


def test_poisson_gaps_are_reproducible_from_the_seed():
    assert poisson_gaps(100, 5.0, seed=1) == poisson_gaps(100, 5.0, seed=1)
    assert poisson_gaps(100, 5.0, seed=1) != poisson_gaps(100, 5.0, seed=2)


@pytest.mark.parametrize("rate", [0.5, 4.0, 50.0])
def test_poisson_gaps_have_mean_one_over_the_rate(rate):
    n = 4000
    gaps = poisson_gaps(n, rate, seed=0)
    # An exponential's standard deviation equals its mean, so the sample mean's is mean / sqrt(n): allow 4 of them.
    mean = 1 / rate
    assert abs(statistics.fmean(gaps) - mean) < 4 * mean / math.sqrt(n)
    assert all(g > 0 for g in gaps)


def test_offsets_at_a_fixed_interval():
    assert send_offsets(4, interval_s=0.02) == pytest.approx([0.0, 0.02, 0.04, 0.06])


def test_offsets_default_to_all_at_once():
    assert send_offsets(3) == [0.0, 0.0, 0.0]


def test_poisson_offsets_start_at_zero_and_add_the_seeded_gaps():
    offsets = send_offsets(5, rate=10.0, seed=3)
    assert offsets[0] == 0.0
    assert [b - a for a, b in zip(offsets, offsets[1:])] == pytest.approx(poisson_gaps(4, 10.0, seed=3))


def test_offsets_refuse_both_an_interval_and_a_rate():
    with pytest.raises(ValueError):
        send_offsets(3, interval_s=0.1, rate=5.0)


def test_prompts_file_holds_strings_or_objects_with_max_tokens(tmp_path):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(["plain", {"prompt": "with a limit", "max_tokens": 7}, {"prompt": "no limit"}]))
    assert load_prompts_file(str(path)) == [("plain", None, None), ("with a limit", 7, None), ("no limit", None, None)]


def test_prompts_file_may_time_every_arrival_or_none(tmp_path):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps([{"prompt": "a", "at_ms": 0}, {"prompt": "b", "at_ms": 250}]))
    assert [at for _, _, at in load_prompts_file(str(path))] == [0, 250]
    path.write_text(json.dumps([{"prompt": "a", "at_ms": 0}, "b"]))
    with pytest.raises(ValueError, match="every item or for none"):
        load_prompts_file(str(path))


def test_prompts_file_refuses_an_item_without_a_prompt(tmp_path):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps([{"text": "wrong key"}]))
    with pytest.raises(ValueError, match="item 0"):
        load_prompts_file(str(path))


def test_long_prompt_workload_sends_long_prompts_while_the_short_ones_decode():
    from benchmarks.scheduler_suite import long_prompt_workload

    items = long_prompt_workload(num_short=64, num_long=16)
    short, long = items[:64], items[64:]
    assert len(long) == 16 and all(item["max_tokens"] == 16 for item in long)
    assert {item["at_ms"] for item in short} == {0.0}  # together, then one long prompt every 50 ms
    assert [item["at_ms"] for item in long] == [100.0 + 50.0 * k for k in range(16)]
    words = [item["prompt"].count("Hello") for item in long]
    assert words[0] == 4000 and words[-1] == 7000 and words == sorted(words)
    assert len({item["prompt"] for item in items}) == len(items)  # nothing shared through the prefix cache
