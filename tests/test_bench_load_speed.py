"""benchmarks/load_speed.py on a tiny shape: it writes a sharded checkpoint with its index, and reports what the
loader read (all of it for one rank, less for a tensor-parallel rank)."""

import json

import pytest

from benchmarks import load_speed
from benchmarks.shapes import SHAPES

TINY = {**SHAPES["llama-3.2-1b"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
TINY |= {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": False}


@pytest.fixture
def tiny_shape(monkeypatch):
    monkeypatch.setitem(SHAPES, "tiny", TINY)


def test_it_writes_shards_and_reads_them_all_onto_the_device(tiny_shape, tmp_path):
    args = ["--shape", "tiny", "--vocab-size", "512", "--shard-size-gb", "0.0001", "--device", "cpu"]
    result = load_speed.main([str(tmp_path / "ckpt"), *args])
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    assert result["shards"] == len(set(index["weight_map"].values())) > 2
    assert result["read_gb"] * 1e9 == pytest.approx(index["metadata"]["total_size"])
    assert result["read_gb_per_s"] > 0

    rank = load_speed.main([str(tmp_path / "ckpt"), *args, "--tensor-parallel-size", "2", "--rank", "1"])
    assert rank["read_gb"] < 0.6 * result["read_gb"]
