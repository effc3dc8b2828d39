"""PNG plots of one serving benchmark run (matplotlib, Agg: no display needed).

latency_cdf.png       empirical CDFs of TTFT, ITL and end-to-end latency
tokens_over_time.png  tokens streamed so far (all requests) against time since the first submit
sweep.png             a Poisson sweep (benchmarks.serving_gap): p99 latencies and throughput by offered rate,
                      the server's beside the client's own (the mock server), the SLOs and the goodput
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.latency import RequestTimings, inter_token_latencies, request_latencies  # noqa: E402


def write_plots(requests: list[RequestTimings], folder: Path, title: str) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    ok = [r for r in requests if r.ok]
    return [
        _latency_cdfs(ok, folder / "latency_cdf.png", title),
        _tokens_over_time(ok, folder / "tokens_over_time.png", title),
    ]


def _latency_cdfs(requests: list[RequestTimings], path: Path, title: str) -> Path:
    series = {
        "TTFT": [request_latencies(r)["ttft"] * 1000 for r in requests],
        "ITL": [gap * 1000 for r in requests for gap in inter_token_latencies(r)],
        "end-to-end": [request_latencies(r)["e2e"] * 1000 for r in requests],
    }
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (name, values) in zip(axes, series.items()):
        values = sorted(values)
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post")
        ax.set_title(f"{name} ({len(values)} samples)")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction ≤ x")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    fig.suptitle(_wrapped(title, fig), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _tokens_over_time(requests: list[RequestTimings], path: Path, title: str) -> Path:
    start = min((r.submit for r in requests), default=0.0)
    times = sorted(t - start for r in requests for t in r.token_streamed)
    submits = sorted(r.submit - start for r in requests)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if times:
        ax.step(times, range(1, len(times) + 1), where="post", label="tokens streamed")
    for i, t in enumerate(submits):
        ax.axvline(t, color="grey", alpha=0.3, linewidth=0.8, label="request submitted" if i == 0 else None)
    ax.set_xlabel("seconds since the first submit")
    ax.set_ylabel("tokens streamed (all requests)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    ax.set_title(_wrapped(title, fig), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_sweep_plot(verdict: dict, path: Path, title: str) -> Path:
    """verdict: benchmarks.serving_gap.goodput's dictionary."""
    server, client, slo = verdict["points"], verdict["client_points"], verdict["slo"]
    fig, (latency, throughput) = plt.subplots(1, 2, figsize=(13, 4.8))
    for points, style, who in ((server, "-", "server"), (client, "--", "client alone (mock server)")):
        rates = [p["rate"] for p in points]
        latency.plot(rates, [p["ttft_p99_ms"] for p in points], "o" + style, color="C0", label=f"TTFT p99, {who}")
        latency.plot(rates, [p["itl_p99_ms"] for p in points], "s" + style, color="C1", label=f"ITL p99, {who}")
        throughput.plot(rates, [p["tok_s"] for p in points], "o" + style, color="C2", label=f"completion tok/s, {who}")
    latency.axhline(slo["ttft_p99_ms"], color="C0", alpha=0.4, linewidth=0.8)
    latency.axhline(slo["itl_p99_ms"], color="C1", alpha=0.4, linewidth=0.8)
    if verdict["burst_tok_s"]:
        throughput.axhline(verdict["burst_tok_s"], color="grey", linestyle=":", label="the burst (1,024 at once)")
    for ax in (latency, throughput):
        if verdict["goodput_req_s"]:
            ax.axvline(verdict["goodput_req_s"], color="k", alpha=0.5, linewidth=0.8)
        ax.set_xlabel("offered rate (Poisson), requests/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    latency.set_yscale("log")
    latency.set_ylabel("ms")
    latency.set_title(
        f"goodput {verdict['goodput_req_s']:g} req/s at TTFT p99 <= {slo['ttft_p99_ms']:g} ms, "
        f"ITL p99 <= {slo['itl_p99_ms']:g} ms",
        fontsize=9,
    )
    throughput.set_ylabel("completion tokens/s")
    fig.suptitle(_wrapped(title, fig), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _wrapped(title: str, fig) -> str:
    """A whole command line as a title: wrapped to the figure's width (about 10 characters an inch at 9 pt)."""
    return textwrap.fill(title, int(fig.get_figwidth() * 10), break_on_hyphens=False)
