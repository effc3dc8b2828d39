"""Offline throughput: this engine against Hugging Face on the same prompts and model, in one run.

    python -m benchmarks.offline --model ../shared/models/gpt2 --load-format dummy

N requests of random token ids (lengths uniform in --input-len-range, seeded), --output-len new tokens
each, greedy, EOS ignored. Prints tokens/s for this engine, for Hugging Face `generate` on static
batches and for its continuous batching `generate_batch`, and the ratios. Every engine is warmed up first
(ours with --warmup-requests other prompts, Hugging Face's with a short generate), so the figures are the
steady state. Ours also reports its TTFT, its host milliseconds per step (everything but waiting for the
device) and, on CUDA, the GPU's busy share over a torch-profiler window of --profile-steps steps and, with
--gpu-clocks, the SM clock and power the GPU held during the timed run (benchmarks/gpu_clocks.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.gpu_clocks import GpuClockLog
from benchmarks.gpu_clocks import describe as describe_clocks
from benchmarks.host_steps import HOST_PARTS, HostStepLog
from benchmarks.roofline import ModelCost, gpu_peak, run_floor
from benchmarks.workloads import parse_range, random_token_prompts
from common.config import EngineConfig, add_engine_args, attention_backend_problem
from common.garbage import freeze_startup_objects
from common.model_info import ModelInfo
from common.model_source import resolve_model
from common.sampling_params import SamplingParams


def run_ours(
    folder: str,
    prompts: list[list[int]],
    output_len: int,
    engine: EngineConfig,
    warmup: list[list[int]],
    profile_prompts: list[list[int]] | None = None,
    profile_steps: int = 0,
    log_clocks: bool = False,
) -> dict:
    """Our engine on `prompts`, after generating for `warmup` (other prompts: nothing they leave in the
    prefix cache helps the timed run), so the figure is the steady state a running server has."""
    from offline import LLM

    llm = LLM.from_config(replace(engine, model=folder))
    stats = llm.scheduler.stats
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    if warmup:
        llm.generate(warmup, params)
    freeze_startup_objects()  # as every server process does once it serves (common/garbage.py)
    _sync()
    host_steps = HostStepLog()
    wall_start = time.time()
    bar = tqdm(total=len(prompts) * output_len, desc="ours", unit="tok", file=sys.stderr)
    start = time.perf_counter()
    steps = 0

    def on_step():
        nonlocal steps
        steps += 1
        # update(), not refresh(): the bar redraws at most every mininterval, not at every step's host expense
        bar.update(stats.generated_tokens - bar.n)

    with GpuClockLog() if log_clocks and torch.cuda.is_available() else nullcontext() as clocks:
        outs = llm.generate(prompts, params, on_step=on_step, observer=host_steps)
        _sync()
    elapsed = time.perf_counter() - start
    bar.close()
    generated = sum(len(o.token_ids) for o in outs)
    ttfts = sorted(o.first_token_time - wall_start for o in outs)
    gpu_busy = gpu_busy_fraction(llm, profile_prompts, params, profile_steps) if profile_steps else None
    decode = host_steps.full_decode_host_ms()
    held = clocks.summary() if clocks is not None else None
    result = {
        "name": "ours",
        "seconds": elapsed,
        "generated_tokens": generated,
        "steps": steps,
        "tokens_per_s": generated / elapsed,
        "warmup_requests": len(warmup),
        "host_ms_per_step": host_steps.host_ms_per_step(),
        "decode_step_host_ms": decode,
        "roofline": roofline(llm, folder, prompts, output_len, elapsed, decode, held and held["sm_mhz_p50"]),
        "gpu_busy": gpu_busy,
        "gpu_clocks": held,
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "num_kv_blocks": llm.runner.limits.num_kv_blocks,
        "attention_backend": type(llm.runner.attention).__name__,
    }
    del llm
    _free()
    return result


def roofline(
    llm,
    folder: str,
    prompts: list[list[int]],
    output_len: int,
    elapsed: float,
    decode: dict | None,
    held_sm_mhz: float | None = None,
):
    """The run's floor on this GPU (benchmarks/roofline.py) and the share of it reached, for the whole run and
    for the fullest decode steps (their median wall time, pipelined as the engine runs them); with the SM clock
    the GPU held (`held_sm_mhz`, --gpu-clocks), the same at that clock too ("held_clock"). None on a CPU or a GPU
    without figures in the table."""
    peak = gpu_peak(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
    if peak is None:
        return None
    config = json.loads((Path(folder) / "config.json").read_text())
    kv_itemsize = llm.runner.eager.kv_cache.data.element_size()
    cost = ModelCost.of(llm.runner.model, config.get("num_attention_heads") or config["n_head"], kv_itemsize)
    fp8 = llm.config.quantization == "fp8"
    full_decode = decode is not None and decode["batch"] == min(len(prompts), llm.runner.limits.max_num_seqs)

    def shares(at) -> dict:
        floor = run_floor(cost, [len(p) for p in prompts], output_len, llm.runner.limits.max_num_seqs, at, fp8)
        step_floor_ms = 1000 * floor["middle_step_s"]
        return {
            "floor_s": floor["seconds"],
            "run_share": floor["seconds"] / elapsed,
            "decode_step_floor_ms": step_floor_ms,
            "decode_step_ms": decode["step_wall"] if full_decode else None,
            "decode_share": step_floor_ms / decode["step_wall"] if full_decode else None,
        }

    out = {"gpu": peak.name, **shares(peak)}
    if held_sm_mhz:
        out["held_clock"] = {"sm_mhz": held_sm_mhz, **shares(peak.at_sm_clock(held_sm_mhz))}
    return out


def describe_roofline(r: dict) -> list[str]:
    """roofline()'s figures as the report prints them: at the datasheet's rates, then at the clock held."""
    line = f"roofline ({r['gpu']} datasheet): the run's floor {r['floor_s']:.2f} s, reached {100 * r['run_share']:.0f}%"
    if r["decode_step_ms"] is not None:
        line += (
            f"; a full decode step {r['decode_step_ms']:.2f} ms against its floor "
            f"{r['decode_step_floor_ms']:.2f} ms ({100 * r['decode_share']:.0f}%)"
        )
    lines = [line]
    if (held := r.get("held_clock")) is not None:
        line = (
            f"roofline at the SM clock the GPU held ({held['sm_mhz']:.0f} MHz; the datasheet's FLOP rates are at "
            f"{gpu_peak(r['gpu']).rated_sm_mhz:.0f}): the run's floor {held['floor_s']:.2f} s, reached "
            f"{100 * held['run_share']:.0f}%"
        )
        if held["decode_step_ms"] is not None:
            step_floor, step_share = held["decode_step_floor_ms"], 100 * held["decode_share"]
            line += f"; a full decode step's floor {step_floor:.2f} ms ({step_share:.0f}%)"
        lines.append(line)
    return lines


PROFILE_AFTER_STEPS = 20  # the window opens after the prefill-heavy start of the run


def gpu_busy_fraction(llm, prompts: list[list[int]], params: SamplingParams, steps: int) -> dict | None:
    """Run `prompts` again (other prompts than the timed run's: nothing cached helps them) under the torch
    profiler for `steps` steps after the first PROFILE_AFTER_STEPS, and return the share of that window's wall
    time in which a GPU kernel ran (intervals merged), with the window's steps and milliseconds. None on a CPU."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    seen = 0

    def on_step() -> None:
        nonlocal seen
        seen += 1
        if seen == PROFILE_AFTER_STEPS:
            torch.cuda.synchronize()
            prof.start()
        elif seen == PROFILE_AFTER_STEPS + steps:
            torch.cuda.synchronize()
            prof.stop()

    llm.generate(prompts, params, on_step=on_step)
    if seen < PROFILE_AFTER_STEPS + steps:
        if seen >= PROFILE_AFTER_STEPS:
            prof.stop()
        return None  # the run was shorter than the window
    events = list(prof.events())
    kernels = sorted(
        (e.time_range.start, e.time_range.end) for e in events if e.device_type == torch.autograd.DeviceType.CUDA
    )
    if not kernels:
        return None
    window = max(e.time_range.end for e in events) - min(e.time_range.start for e in events)
    busy, end = 0.0, float("-inf")
    for start, stop in kernels:  # union of the kernel intervals
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return {"fraction": busy / window, "window_ms": window / 1000, "steps": steps}


def _hf_model(folder: str, load_format: str, dtype: torch.dtype, device: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    if load_format == "dummy":
        config = AutoConfig.from_pretrained(folder)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return model.to(device).eval()


def run_hf_generate(model, prompts: list[list[int]], output_len: int, batch_size: int, device: str) -> dict:
    """Static batches: left-padded, every sequence runs until the batch's last one is done."""
    pad = 0
    generated = 0
    with torch.inference_mode():  # warm-up: kernels and allocator ready before the clock starts
        model.generate(
            torch.tensor([prompts[0][:16]], device=device),
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=None,
        )
    _sync()
    bar = tqdm(total=len(prompts) * output_len, desc="hf generate", unit="tok", file=sys.stderr)
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i : i + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=None,
            )
            generated += (out.shape[1] - width) * len(batch)
            bar.update((out.shape[1] - width) * len(batch))
    _sync()
    elapsed = time.perf_counter() - start
    bar.close()
    return {
        "name": "hf_generate",
        "seconds": elapsed,
        "generated_tokens": generated,
        "tokens_per_s": generated / elapsed,
        "batch_size": batch_size,
    }


def run_hf_generate_batch(model, prompts: list[list[int]], output_len: int) -> dict:
    """Hugging Face's own continuous batching (paged attention)."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=-1, pad_token_id=0)
    model.generate_batch(
        inputs=[prompts[0][:16]],
        generation_config=GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0),
    )  # warm-up
    _sync()
    start = time.perf_counter()
    outputs = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=True)
    _sync()
    elapsed = time.perf_counter() - start
    failed = [o.error for o in outputs.values() if o.error]
    if failed:
        raise RuntimeError(f"generate_batch failed {len(failed)} requests: {failed[0]}")
    generated = sum(len(o.generated_tokens) for o in outputs.values())
    return {
        "name": "hf_generate_batch",
        "seconds": elapsed,
        "generated_tokens": generated,
        "tokens_per_s": generated / elapsed,
    }


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="folder, .gguf or hub id (default: embedded SmolLM2)")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--input-len-range", default="64-512")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument(
        "--baselines",
        default="generate,generate_batch",
        help="comma-separated Hugging Face baselines to run: generate, generate_batch, or none",
    )
    parser.add_argument(
        "--warmup-requests",
        type=int,
        default=16,
        help="our engine first generates for this many other prompts, untimed (0: time a cold engine)",
    )
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=50,
        help="CUDA: after the timed run, profile this many steps of a second run and report the GPU's busy share",
    )
    parser.add_argument(
        "--gpu-clocks",
        action="store_true",
        help="CUDA: sample the SM clock and power (nvidia-smi, every 100 ms) during the timed run and report them. "
        "Off unless asked: the sampling slowed host-bound runs (GPT-2's W1 by up to 8%% on an H200)",
    )
    parser.add_argument("--hf-batch-size", type=int, default=64, help="static batch size for HF generate")
    parser.add_argument("--json", help="write the results here")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    problem = attention_backend_problem(args.attention_backend, args.device)
    if problem is not None:
        parser.error(problem)

    folder = str(resolve_model(args.model))
    engine = EngineConfig.from_args(args)
    info = ModelInfo.from_folder(folder)

    def workload(num: int, seed_offset: int) -> list[list[int]]:
        """Seed + 0: the timed prompts; + 1: the warm-up's; + 2: the profiled run's (none shares a block)."""
        lengths = parse_range(args.input_len_range)
        eos = frozenset(info.eos_token_ids)
        return random_token_prompts(num, lengths, info.vocab_size, seed=args.workload_seed + seed_offset, avoid=eos)

    prompts, warmup, profile_prompts = workload(args.num_requests, 0), workload(args.warmup_requests, 1), []
    if args.profile_steps and torch.cuda.is_available():
        profile_prompts = workload(args.num_requests, 2)
    results = [
        run_ours(folder, prompts, args.output_len, engine, warmup, profile_prompts, args.profile_steps, args.gpu_clocks)
    ]
    baselines = [b for b in args.baselines.split(",") if b and b != "none"]
    if baselines:
        from gpu_worker.builder import resolve_device
        from gpu_worker.model_loader import resolve_dtype

        device = resolve_device(args.device)
        model = _hf_model(folder, args.load_format, resolve_dtype(args.dtype, device), str(device))
        for name in baselines:
            if name == "generate":
                results.append(run_hf_generate(model, prompts, args.output_len, args.hf_batch_size, str(device)))
            elif name == "generate_batch":
                results.append(run_hf_generate_batch(model, prompts, args.output_len))
            else:
                parser.error(f"unknown baseline {name!r}")
    ours = results[0]["tokens_per_s"]
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(
        f"\n{args.num_requests} requests, prompts {args.input_len_range} tokens, {args.output_len} new tokens, "
        f"greedy, EOS ignored; {device_name}"
    )
    print(f"{'engine':<20}{'tokens/s':>12}{'seconds':>10}{'ours / this':>14}")
    for r in results:
        print(f"{r['name']:<20}{r['tokens_per_s']:>12.0f}{r['seconds']:>10.1f}{ours / r['tokens_per_s']:>14.2f}")
    first = results[0]
    print(
        f"ours: warmed up with {first['warmup_requests']} requests; TTFT p50 {1000 * first['ttft_p50_s']:.1f} ms, "
        f"p99 {1000 * first['ttft_p99_s']:.1f} ms (from the start of generate); {first['steps']} steps, "
        f"host {first['host_ms_per_step']:.2f} ms per step (all but waiting for the device)"
    )
    if first["decode_step_host_ms"] is not None:
        d = first["decode_step_host_ms"]
        parts = ", ".join(f"{name} {d[name]:.3f}" for name in HOST_PARTS[:-1])
        print(
            f"ours: host per {d['batch']}-request decode step (median of {d['passes']}): {d['total']:.2f} ms "
            f"({parts}; ms)"
        )
    if first["roofline"] is not None:
        print("\n".join(describe_roofline(first["roofline"])))
    if (clocks := describe_clocks(first["gpu_clocks"])) is not None:
        print(f"ours: {clocks}")
    if first["gpu_busy"] is not None:
        g = first["gpu_busy"]
        print(f"ours: GPU busy {100 * g['fraction']:.0f}% of a {g['window_ms']:.0f} ms window of {g['steps']} steps")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": device_name, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
