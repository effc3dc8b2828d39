"""The command line as vLLM users type it: no prefix matching, the model as a positional, vLLM's spellings
of the flags this server has, and defaults shown in --help."""

from __future__ import annotations

import argparse
import json
import os

import pytest

import launch
from common.flags import GROUPS
from launch import build_parser, parse_args


def launch_refused(argv: list[str], env: dict[str, str] | None = None) -> tuple[str, str]:
    """launch.py run with argv (and a free port) must stop before any process starts: exit 2, one ERROR line, no
    traceback. Returns that line and the whole stderr."""
    import subprocess
    import sys

    from tests.server_process import ROOT, free_port

    done = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), *argv, "--port", str(free_port())],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1, done.stderr
    assert "Traceback" not in done.stderr
    return errors[0], done.stderr


def test_the_model_can_be_given_as_a_positional_or_with_model():
    assert parse_args(["some/folder"]).model == "some/folder"
    assert parse_args(["--model", "some/folder"]).model == "some/folder"
    assert parse_args([]).model is None


def test_two_different_models_are_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["a", "--model", "b"])
    assert "two models given" in capsys.readouterr().err


def test_a_flag_prefix_is_not_read_as_a_longer_flag(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--tokenizer-w", "4"])
    assert "unrecognized arguments" in capsys.readouterr().err
    args = parse_args(["--tokenizer", "tok/folder"])
    assert args.tokenizer == "tok/folder" and args.tokenizer_workers == 2


@pytest.mark.parametrize(("given", "dtype"), [("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16")])
def test_vllm_dtype_spellings(given, dtype):
    assert parse_args(["--dtype", given]).dtype == dtype


def test_vllm_flag_spellings_set_the_same_settings():
    assert parse_args([]).enable_prefix_caching is True
    assert parse_args(["--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert parse_args(["--no-prefix-cache"]).enable_prefix_caching is False
    assert parse_args(["--no-enable-chunked-prefill"]).enable_chunked_prefill is False
    assert parse_args(["--num-gpu-blocks-override", "12"]).num_kv_blocks == 12
    assert parse_args([]).data_parallel_size == 1
    assert parse_args(["--data-parallel-size", "2"]).data_parallel_size == 2
    assert parse_args(["-dp", "2"]).data_parallel_size == 2


def test_no_engine_replicas_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--data-parallel-size", "0"])
    assert "--data-parallel-size must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags",
    [["--max-grammar-bytes", "0"], ["--grammar-compile-timeout", "0"], ["--grammar-compile-timeout", "-1"]],
)
def test_a_grammar_bound_that_would_refuse_every_grammar_is_refused(capsys, flags):
    with pytest.raises(SystemExit):
        parse_args(flags)
    assert "--max-grammar-bytes must be at least 1 and --grammar-compile-timeout above 0" in capsys.readouterr().err


def test_the_grammar_bounds_defaults():
    args = parse_args([])
    assert (args.max_grammar_bytes, args.grammar_compile_timeout) == (256 * 1024, 10.0)


def test_the_liveness_flags_defaults_and_a_negative_timeout_is_refused(capsys):
    args = parse_args([])
    assert (args.watchdog_timeout, args.engine_iteration_timeout, args.exit_on_replica_failure) == (10, 60, False)
    with pytest.raises(SystemExit):
        parse_args(["--engine-iteration-timeout", "-1"])
    assert "must be 0 (off) or more" in capsys.readouterr().err


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 127.0.0.1)" in out and "(default: 8000)" in out and "(default: 256)" in out


def test_every_flag_has_a_help_text_that_shows_one_default():
    parser = build_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        assert action.help, f"{action.option_strings or action.dest} has no help"
        shown = formatter._expand_help(action)
        assert shown.count("default:") == 1 and "(default: None)" not in shown, shown


def test_help_lists_the_flags_in_vllms_groups(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    positions = [out.index(f"\n{title}:\n") for title in GROUPS]
    assert positions == sorted(positions)
    where = {flag: out.index(f"\n  {flag}") for flag in ("--block-size", "--max-num-seqs")}
    assert out.index("\ncache:") < where["--block-size"] < out.index("\nscheduler:") < where["--max-num-seqs"]


def test_the_api_server_count_default_is_a_quarter_of_the_cores_from_1_to_4(monkeypatch):
    for cores, frontends in ((2, 1), (8, 2), (16, 4), (128, 4)):
        monkeypatch.setattr("os.cpu_count", lambda cores=cores: cores)
        assert parse_args([]).api_server_count == frontends, f"{cores} cores"
    assert parse_args(["--api-server-count", "3"]).api_server_count == 3


def test_the_api_server_count_default_grows_to_4_per_replica_where_the_cores_allow(monkeypatch):
    for cores, frontends in ((16, 4), (32, 8), (128, 8)):
        monkeypatch.setattr("os.cpu_count", lambda cores=cores: cores)
        assert parse_args(["-dp", "2", "-dpl", "1"]).api_server_count == frontends, f"{cores} cores"


def test_the_api_server_count_default_is_at_least_one_per_replica_of_the_group(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert parse_args(["-dp", "4"]).api_server_count == 4
    # Remote replicas stream through this node's frontends too.
    assert parse_args(["-dp", "4", "--data-parallel-size-local", "1"]).api_server_count == 4
    assert parse_args(["-dp", "4", "--api-server-count", "1"]).api_server_count == 1


def test_node_flags_take_vllms_names_and_a_headless_node_serves_the_replicas_from_its_start_rank():
    args = parse_args(["-dp", "4", "-dpl", "2", "-dpr", "2", "-dpa", "10.0.0.1", "-dpp", "4000", "--headless"])
    assert (args.data_parallel_size_local, args.data_parallel_start_rank) == (2, 2)
    assert (args.data_parallel_address, args.data_parallel_rpc_port, args.headless) == ("10.0.0.1", 4000, True)
    assert parse_args(["-dp", "4", "-dpr", "3", "--headless"]).data_parallel_size_local == 1  # the rest


@pytest.mark.parametrize(
    "flags, error",
    [
        (["-dp", "2", "-dpr", "1"], "--data-parallel-start-rank is a headless node's"),
        (["-dp", "2", "-dpl", "2", "-dpr", "1", "--headless"], "replicas 1 to 2"),
        (["-dp", "2", "-dpl", "0", "-dpr", "1", "--headless"], "--headless needs at least one replica"),
    ],
)
def test_node_flags_that_leave_a_replica_outside_the_data_parallel_size_are_refused(flags, error, capsys):
    with pytest.raises(SystemExit):
        parse_args(flags)
    assert error in capsys.readouterr().err


def test_the_api_key_comes_from_the_environment_and_help_never_prints_it(monkeypatch, capsys):
    monkeypatch.setenv("CLEARSERVE_API_KEY", "s3cret")
    assert parse_args([]).api_key == "s3cret"
    assert parse_args(["--api-key", "other"]).api_key == "other"
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    assert "s3cret" not in capsys.readouterr().out


def test_a_model_folder_without_weights_fails_in_one_line_before_any_process_starts(tmp_path):
    from tests.tiny_models import build_model

    folder = build_model("gpt2", tmp_path / "model")
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    error, _ = launch_refused([str(folder)])
    assert "no *.safetensors" in error and "--load-format dummy" in error


def test_a_quantization_the_engine_does_not_serve_fails_in_one_line_before_any_process_starts(tmp_path):
    from tests.tiny_models import build_model

    folder = build_model("gpt2", tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": awq}))
    error, stderr = launch_refused([str(folder)])
    assert "the checkpoint is quantized (quant_method 'awq')" in error and "starting" not in stderr


def test_an_architecture_the_engine_does_not_run_fails_in_one_line_before_any_process_starts(tmp_path):
    from common.model_info import SUPPORTED_MODEL_TYPES
    from tests.tiny_models import build_model

    folder = build_model("gpt2", tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "falcon", "architectures": ["Falcon"]}))
    error, stderr = launch_refused([str(folder)])
    assert "model_type 'falcon' (Falcon) is not supported" in error
    assert "supported: " + ", ".join(SUPPORTED_MODEL_TYPES) in error
    assert "starting" not in stderr


@pytest.mark.parametrize(
    ("arch", "experts", "why"),
    [
        ("falcon", 0, "the engine does not run it"),
        ("olmo2", 0, "transformers' GGUF reader has no olmo2"),
        ("llama", 8, "a llama file with experts (Mixtral)"),
        ("qwen3moe", 0, "transformers' GGUF reader does not convert its stacked experts"),
    ],
)
def test_a_gguf_file_that_would_not_convert_or_run_fails_in_one_line_before_any_process_starts(
    tmp_path, arch, experts, why
):
    """Read from the file's metadata before transformers converts anything (common/model_info.py)."""
    import gguf
    import numpy as np

    from common.model_info import GGUF_ARCHITECTURES, SUPPORTED_MODEL_TYPES

    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    if experts:
        writer.add_expert_count(experts)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    error, stderr = launch_refused([str(path)], env={**os.environ, "CLEARSERVE_CACHE": str(tmp_path / "cache")})
    assert f"GGUF architecture {arch!r} ({arch}.gguf) is not supported: {why}" in error
    assert ", ".join(GGUF_ARCHITECTURES) in error and ", ".join(SUPPORTED_MODEL_TYPES) in error
    assert "converting" not in stderr and "starting" not in stderr


def test_requests_without_max_tokens_default_to_a_bounded_length(capsys):
    assert parse_args([]).default_max_tokens == 512
    assert parse_args(["--default-max-tokens", "0"]).default_max_tokens == 0, "0: the rest of the context"
    with pytest.raises(SystemExit):
        parse_args(["--default-max-tokens", "-1"])
    assert "--default-max-tokens" in capsys.readouterr().err


def test_a_chat_template_that_cannot_be_read_fails_in_one_line_before_any_process_starts(tmp_path):
    template = str(tmp_path / "missing.jinja")
    error, _ = launch_refused(["--chat-template", template, "--load-format", "dummy", str(tmp_path)])
    assert "missing.jinja" in error and "no such file" in error


def test_a_hub_id_the_hub_cannot_serve_names_the_local_ways_to_run():
    from common.model_source import ModelNotFound, resolve_model

    with pytest.raises(ModelNotFound) as raised:
        resolve_model("no-such-org/no-such-model")  # the tests run with HF_HUB_OFFLINE=1
    message = str(raised.value)
    assert "\n" not in message and "local folder" in message and "--load-format dummy" in message


def test_generation_config_auto_takes_the_models_sampling_defaults_and_vllm_none(tmp_path, capsys):
    from launch import model_sampling_defaults

    model = tmp_path / "model"
    model.mkdir()
    (model / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": None, "do_sample": True, "eos_token_id": 2})
    )
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.2}))
    assert model_sampling_defaults("auto", model) == {"temperature": 0.6, "top_p": 0.9}  # numbers only
    assert model_sampling_defaults("vllm", model) == {}
    assert model_sampling_defaults(str(other), model) == {"repetition_penalty": 1.2}
    assert model_sampling_defaults("auto", other.parent) == {}  # no generation_config.json: none
    assert parse_args(["--generation-config", str(other)]).generation_config == str(other)
    with pytest.raises(SystemExit):
        parse_args(["--generation-config", str(tmp_path)])
    assert "no generation_config.json there" in capsys.readouterr().err


def test_the_clearserve_command_is_launch_cli():
    tomllib = pytest.importorskip("tomllib", reason="the standard library reads TOML from Python 3.11")
    with open("pyproject.toml", "rb") as f:
        assert tomllib.load(f)["project"]["scripts"] == {"clearserve": "launch:cli"}


def test_clearserve_help_lists_serve_and_bench(capsys):
    with pytest.raises(SystemExit) as exit:
        launch.cli(["--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: clearserve") and "serve" in out and "bench" in out


def test_clearserve_serve_is_launch_py_with_the_same_arguments(monkeypatch):
    started = []
    monkeypatch.setattr(launch, "Launcher", lambda args: started.append(args) or pytest.fail("stop here"))
    with pytest.raises(pytest.fail.Exception):
        launch.cli(["serve", "--model", "some/folder", "--port", "8123", "-dp", "2"])
    assert started == [parse_args(["--model", "some/folder", "--port", "8123", "--data-parallel-size", "2"])]


def test_clearserve_serve_help_names_the_command(capsys):
    with pytest.raises(SystemExit) as exit:
        launch.cli(["serve", "--help"])
    assert exit.value.code == 0
    assert capsys.readouterr().out.startswith("usage: clearserve serve [-h]")


def test_clearserve_bench_runs_the_named_benchmark_with_its_own_arguments(capsys):
    with pytest.raises(SystemExit) as exit:
        launch.cli(["bench", "shapes", "--help"])
    assert exit.value.code == 0
    assert "--tokenizer-from" in capsys.readouterr().out


def test_clearserve_bench_refuses_a_benchmark_that_is_not_there(capsys):
    with pytest.raises(SystemExit):
        launch.cli(["bench", "nonesuch"])
    err = capsys.readouterr().err
    assert "invalid choice: 'nonesuch'" in err and "serve" in err
