"""How fast the engine's loader reads a real-sized safetensors checkpoint onto the device, and how much CPU
memory it takes doing so.

    python -m benchmarks.load_speed --shape llama-3-8b --device cuda /tmp/ckpt-8b          # 16 GB, 4 shards
    python -m benchmarks.load_speed --shape llama-3.2-1b --layers 2 --vocab-size 32000 --device cpu /tmp/ckpt

writes (once; an existing folder of the same shape is reused) a checkpoint of the shape (benchmarks/shapes.py)
as Hugging Face lays it out: bf16 random values, shards of --shard-size-gb and model.safetensors.index.json.
Then it reads every shard once (so the files come from the page cache, as on a warm restart), builds the
model (gpu_worker/model_loader.py: build_model) and times the loader filling it (read_weights): GB/s of the
bytes this rank read (with --tensor-parallel-size N, rank --rank's share: no process group is needed to load),
and the peak of the process's RssAnon (copies in CPU memory) and RssFile (mapped page-cache pages, not
copies) above where they stood before the load, sampled every 5 ms.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import threading
import time
from pathlib import Path

import torch

from benchmarks.shapes import SHAPES

GIB = 2**30


def checkpoint_config(shape: str, layers: int | None, vocab_size: int) -> dict:
    config = {**SHAPES[shape], "vocab_size": vocab_size, "torch_dtype": "bfloat16"}
    if layers is not None:
        config["num_hidden_layers"] = layers
    return config


def write_checkpoint(folder: Path, config: dict, shard_bytes: int, seed: int = 0) -> int:
    """config.json, the shards and their index, as save_pretrained writes them; returns the weights' bytes.
    Values: one random bf16 block (std 0.02) repeated, so that writing 16 GB takes no minute of the CPU's
    generator."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        shapes.pop("lm_head.weight", None)
    gen = torch.Generator().manual_seed(seed)
    block = (torch.randn(16 * 2**20, generator=gen) * 0.02).to(torch.bfloat16)

    def values(shape: tuple[int, ...]) -> torch.Tensor:
        n = math.prod(shape)
        return block.repeat(-(-n // block.numel()))[:n].view(shape)

    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * 2
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map = {}
    for i, names in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({name: values(shapes[name]) for name in names}, folder / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(names, file)
    total = sum(math.prod(s) * 2 for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def warm_page_cache(files: list[str]) -> None:
    buffer = bytearray(64 * 2**20)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


class RssPeak:
    """The peak RssAnon and RssFile (bytes) of this process above their values at start, sampled every 5 ms."""

    def __init__(self):
        self.base = _rss()
        self.peak = dict(self.base)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            for key, value in _rss().items():
                self.peak[key] = max(self.peak[key], value)

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def above_start(self) -> dict[str, int]:
        return {key: self.peak[key] - self.base[key] for key in self.base}


def _rss() -> dict[str, int]:
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) * 1024
    return fields


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="where the checkpoint is written (reused if it holds this shape)")
    parser.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, help="fewer decoder layers than the shape's (a smaller checkpoint)")
    parser.add_argument("--vocab-size", type=int, default=128256, help="default: Llama 3's")
    parser.add_argument("--shard-size-gb", type=float, default=5.0, help="as save_pretrained's max_shard_size")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--rank", type=int, default=0, help="the tensor-parallel rank whose share is read")
    parser.add_argument("--progress", action="store_true", help="draw the loader's progress bar (stderr)")
    args = parser.parse_args(argv)
    from common.model_source import checkpoint_files
    from gpu_worker.model_loader import build_model, read_weights
    from gpu_worker.parallel import TensorParallel

    folder = Path(args.folder)
    config = checkpoint_config(args.shape, args.layers, args.vocab_size)
    config_file = folder / "config.json"
    if not (config_file.is_file() and json.loads(config_file.read_text()) == config):
        start = time.perf_counter()
        total = write_checkpoint(folder, config, int(args.shard_size_gb * 1e9))
        print(f"wrote {total / 1e9:.2f} GB in {time.perf_counter() - start:.1f} s to {folder}", flush=True)
    files = checkpoint_files(folder)
    checkpoint_bytes = sum(os.path.getsize(f) for f in files)
    warm_page_cache(files)

    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tp = TensorParallel(args.rank, args.tensor_parallel_size)
    start = time.perf_counter()
    model, _ = build_model(str(folder), torch.bfloat16, device, tp=tp)
    sync()
    built = time.perf_counter()
    with RssPeak() as rss:
        bytes_read = read_weights(model, str(folder), device, progress=args.progress)
        sync()
    seconds = time.perf_counter() - built
    peak = rss.above_start()
    result = {
        "shape": args.shape,
        "layers": config["num_hidden_layers"],
        "device": str(device),
        "tensor_parallel": f"rank {args.rank} of {args.tensor_parallel_size}",
        "shards": len(files),
        "checkpoint_gb": checkpoint_bytes / 1e9,
        "read_gb": bytes_read / 1e9,
        "build_s": built - start,
        "read_s": seconds,
        "read_gb_per_s": bytes_read / 1e9 / seconds,
        "peak_rss_anon_gb": peak["RssAnon"] / 1e9,
        "peak_rss_file_gb": peak["RssFile"] / 1e9,
    }
    print(
        f"{args.shape} ({result['layers']} layers, {len(files)} shards, {result['checkpoint_gb']:.2f} GB) onto "
        f"{device}, {result['tensor_parallel']}: read {result['read_gb']:.2f} GB in {seconds:.2f} s = "
        f"{result['read_gb_per_s']:.2f} GB/s (model built in {result['build_s']:.2f} s before); peak CPU memory "
        f"above start: RssAnon {result['peak_rss_anon_gb']:.3f} GB, RssFile {result['peak_rss_file_gb']:.2f} GB "
        f"(mapped page cache)"
    )
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
