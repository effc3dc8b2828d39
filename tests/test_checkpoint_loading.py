"""Loading a checkpoint (gpu_worker/checkpoint_reader.py, model_loader.py): a sharded folder loads the same model
as one file (and a .bin file as safetensors), its index naming the shards; a tensor-parallel rank reads only
its part of each split tensor; the progress bar walks the checkpoint's bytes shard by shard."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from common.model_source import ModelNotFound, checkpoint_files
from gpu_worker.checkpoint_reader import CheckpointReader
from gpu_worker.model_loader import build_model, load_model, read_weights
from gpu_worker.parallel import SINGLE, TensorParallel

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def sharded_llama(tiny_llama, tmp_path_factory):
    """The tiny Llama saved again in several shards with their index."""
    folder = tmp_path_factory.mktemp("sharded-llama")
    AutoModelForCausalLM.from_pretrained(tiny_llama).save_pretrained(folder, max_shard_size="100KB")
    return folder


def params(folder, tp: TensorParallel = SINGLE) -> dict[str, torch.Tensor]:
    return dict(load_model(str(folder), "auto", torch.float32, CPU, tp=tp).named_parameters())


def test_a_sharded_checkpoint_loads_the_same_weights_as_one_file(tiny_llama, sharded_llama):
    assert len(checkpoint_files(sharded_llama)) >= 3
    whole, sharded = params(tiny_llama), params(sharded_llama)
    assert whole.keys() == sharded.keys()
    assert all(torch.equal(whole[name], sharded[name]) for name in whole)


def test_a_pytorch_model_bin_loads_the_same_weights_as_safetensors(tiny_llama, tmp_path):
    folder = tmp_path / "bin"
    shutil.copytree(tiny_llama, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    state = AutoModelForCausalLM.from_pretrained(tiny_llama).state_dict()
    torch.save(state, folder / "pytorch_model.bin")
    whole, from_bin = params(tiny_llama), params(folder)
    assert all(torch.equal(whole[name], from_bin[name]) for name in whole)


def test_only_the_shards_the_index_names_are_read(sharded_llama, tmp_path):
    """A folder may hold another copy of the weights beside the shards (Mistral's consolidated.safetensors)."""
    folder = tmp_path / "model"
    shutil.copytree(sharded_llama, folder)
    save_file({"tok_embeddings.weight": torch.zeros(4, 4)}, folder / "consolidated.safetensors")
    assert str(folder / "consolidated.safetensors") not in checkpoint_files(folder)
    loaded = params(folder)
    assert all(torch.equal(loaded[name], p) for name, p in params(sharded_llama).items())


def test_an_index_naming_a_missing_shard_fails_naming_it(sharded_llama, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(sharded_llama, folder)
    last = sorted(folder.glob("model-*.safetensors"))[-1]
    last.unlink()
    with pytest.raises(ModelNotFound, match=last.name):
        checkpoint_files(folder)


def bytes_read(folder, tp: TensorParallel) -> int:
    model, _ = build_model(str(folder), torch.float32, CPU, tp=tp)
    return read_weights(model, str(folder), CPU)


def test_each_tensor_parallel_rank_reads_only_its_part(sharded_llama):
    """The ranks together read the checkpoint once, plus once more per extra rank the tensors every rank keeps
    whole (the norms)."""
    whole = bytes_read(sharded_llama, SINGLE)
    ranks = [bytes_read(sharded_llama, TensorParallel(r, 2)) for r in range(2)]
    one, two = params(sharded_llama), params(sharded_llama, TensorParallel(1, 2))
    kept_whole = sum(p.nbytes for name, p in one.items() if p.shape == two[name].shape)
    assert sum(ranks) == whole + kept_whole
    assert max(ranks) < 0.6 * whole


def test_a_transposed_checkpoint_tensor_reads_what_torch_would(tmp_path):
    """GPT-2's Conv1D weights are stored [in, out] and read transposed, each rank its rows or columns."""
    stored = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4)
    save_file({"w": stored}, tmp_path / "w.safetensors")
    for _, tensor in CheckpointReader([str(tmp_path / "w.safetensors")], CPU):
        transposed = tensor.t()
        assert transposed.shape == (4, 6)
        for index in [..., slice(1, 3), (slice(None), slice(2, 5)), (slice(0, 2), slice(1, 4)), 2]:
            assert torch.equal(transposed[index], stored.t()[index]), index


def test_the_progress_bar_walks_the_checkpoint_bytes_shard_by_shard(sharded_llama, capsys):
    files = checkpoint_files(sharded_llama)
    model, _ = build_model(str(sharded_llama), torch.float32, CPU)
    read_weights(model, str(sharded_llama), CPU, progress=True)
    err = capsys.readouterr().err
    assert "Loading weights:   0%" in err
    assert "100%" in err.rsplit("Loading weights:", 1)[1]
    assert f"shard {len(files)}/{len(files)}" in err
