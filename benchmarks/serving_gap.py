"""The serving path against its own engine, in one run: how much of the in-process engine's throughput the
HTTP server delivers, and what limits it.

    python -m benchmarks.serving_gap --model ../shared/models/gpt2 --out results/   # every part, on the GPU
    python -m benchmarks.serving_gap --model M --out DIR --parts w1 --api-server-counts 1,2,4

Parts (each a list of `benchmarks.offline` / `benchmarks.serve` commands, printed before they run):
- ceilings: the client's ceiling (benchmarks.mock_server) and the serving path's (--load-format null).
- w1: the warm in-process engine, and the server with each --api-server-count (and, with --base-root, the
  server of another checkout: the "before"). 256 requests, prompts of 64-512 random ids, 256 new tokens.
- burst: 1,024 such requests at once, engine and server (TTFT against the engine's).
- sweep: Poisson arrivals at increasing rates against one server, until it saturates: throughput against
  TTFT p99 and ITL p99 (sweep.json, sweep.png); with --base-root, then the same against that checkout's server
  (base_sweep.json, base_sweep.png), to tell a change from a host.
- parallel (more than one GPU): W1 through the server with each --tensor-parallel-sizes, and the burst with
  each --data-parallel-sizes at 256 seats per replica (one replica is then saturated four waves over, two
  replicas two waves each: the load that can scale), the sizes interleaved --repeats times. The step period
  (the GPU worker's own token gaps, "ITL as sampled" p50) says whether a replica slowed down.
Every serve figure comes with the client's own CPU use; a table of all of them ends the run (table.md).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.load_client import default_client_processes

W1 = "--num-requests 256 --input-len-range 64-512 --max-new-tokens 256 --no-stop-on-eos"
W1_OFFLINE = "--num-requests 256 --input-len-range 64-512 --output-len 256"
BURST = "--num-requests 1024 --input-len-range 64-512 --max-new-tokens 256 --no-stop-on-eos"
BURST_OFFLINE = "--num-requests 1024 --input-len-range 64-512 --output-len 256"
SWEEP_RATES = "100,200,400,600,800,1000,1200,1500,2000"  # requests/s


def run(args: list[str], log: Path) -> None:
    command = [sys.executable, "-m", *args]
    print("$ python -m " + shlex.join(args), flush=True)
    with open(log, "a") as f:
        f.write("$ python -m " + shlex.join(args) + "\n")
        f.flush()
        done = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        print(f"  failed with exit code {done.returncode}; see {log}", flush=True)


def serve(label: str, flags: str, out: Path, log: Path, rows: list[dict]) -> dict | None:
    path = out / f"{label}.json"
    run(["benchmarks.serve", *shlex.split(flags), "--label", label, "--output-json", str(path)], log)
    if not path.exists():
        return None
    result = json.loads(path.read_text())
    s, c = result["summary"], result["client"]
    processes = result.get("processes") or {}
    rows.append(
        {
            "label": label,
            "command": result["command"],
            "tok_s": s["completion_throughput"],
            "failed": s["failed"],
            "ttft_p50_ms": s["latencies_ms"]["ttft"]["p50"],
            "ttft_p99_ms": s["latencies_ms"]["ttft"]["p99"],
            "itl_p99_ms": s["latencies_ms"]["itl"]["p99"],
            "step_ms": s["latencies_ms"].get("itl_sampled", {}).get("p50"),
            "client": f"{c['processes']} × peak {max(c['peak_cpu_pct'], default=0):.0f}%",
            "busy": ", ".join(f"{r} {p['busy_pct']:.0f}%" for r, p in processes.items()),
            # Where the time went: each process's CPU µs per completion token (from /proc; its busy µs where the
            # server is not this machine's), busy ms per request, its messages and msgpack seconds over the run.
            "per_token_us": {
                r: p["cpu_us_per_token"]
                if p.get("cpu_us_per_token") is not None
                else 1e6 * p["busy_s"] / max(1, s["completion_tokens"])
                for r, p in processes.items()
            },
            "per_request_ms": {r: 1e3 * p["busy_s"] / max(1, s["completed"]) for r, p in processes.items()},
            "processes": processes,
            "server": result.get("server"),
            "client_usage": c,
        }
    )
    return result


def offline(label: str, flags: str, out: Path, log: Path, rows: list[dict]) -> None:
    path = out / f"{label}.json"
    run(["benchmarks.offline", *shlex.split(flags), "--baselines", "none", "--json", str(path)], log)
    if not path.exists():
        return
    ours = json.loads(path.read_text())["results"][0]
    rows.append(
        {
            "label": label,
            "command": "python -m benchmarks.offline " + flags,
            "tok_s": ours["tokens_per_s"],
            "failed": 0,
            "ttft_p50_ms": 1000 * ours["ttft_p50_s"],
            "ttft_p99_ms": 1000 * ours["ttft_p99_s"],
            "itl_p99_ms": None,
            "step_ms": None,
            "client": "in-process",
            "busy": f"{ours['steps']} steps",
        }
    )


@dataclass(slots=True)
class Slo:
    """The latency objectives a rate must meet to count toward goodput: p99s over the run, no failed request."""

    ttft_ms: float
    itl_ms: float

    def met(self, point: dict) -> bool:
        return (
            point["failed"] == 0
            and point["ttft_p99_ms"] is not None
            and point["ttft_p99_ms"] <= self.ttft_ms
            and (point["itl_p99_ms"] or 0.0) <= self.itl_ms
        )


def sweep_point(rate: float, result: dict) -> dict:
    s = result["summary"]
    return {
        "rate": rate,
        "req_s": s["request_throughput"],
        "tok_s": s["completion_throughput"],
        "ttft_p99_ms": s["latencies_ms"]["ttft"]["p99"],
        "itl_p99_ms": s["latencies_ms"]["itl"]["p99"],
        "failed": s["failed"],
        "client_peak_cpu_pct": max(result["client"]["peak_cpu_pct"], default=0.0),
    }


def goodput(points: list[dict], client: list[dict], burst_tok_s: float | None, slo: Slo) -> dict:
    """The highest rate whose server point meets the SLOs, the throughput there, and whether the client could
    have been the limit: its own point (the same arrivals against benchmarks.mock_server) at that rate and at
    the first rate the server missed must meet the SLOs too, or the verdict is the client's, not the server's."""
    met = [p for p in points if slo.met(p)]
    best = max(met, key=lambda p: p["rate"], default=None)
    missed = [p for p in points if not slo.met(p) and (best is None or p["rate"] > best["rate"])]
    client_at = {p["rate"]: p for p in client}
    checked = [r for r in (best and best["rate"], missed and missed[0]["rate"]) if r]
    client_limited = any(r not in client_at or not slo.met(client_at[r]) for r in checked)
    saturation = max((p["tok_s"] for p in points), default=0.0)
    return {
        "slo": {"ttft_p99_ms": slo.ttft_ms, "itl_p99_ms": slo.itl_ms},
        "goodput_req_s": best["rate"] if best else 0.0,
        "goodput_point": best,
        "client_limited": client_limited,
        "saturation_tok_s": saturation,
        "burst_tok_s": burst_tok_s,
        "saturation_of_burst": saturation / burst_tok_s if burst_tok_s else None,
        "points": points,
        "client_points": client,
    }


def sweep(
    model: str,
    launch: str,
    clients: int,
    mock: int,
    rates: list[float],
    seconds: float,
    slo: Slo,
    out: Path,
    log: Path,
    rows: list[dict],
    base_root: Path | None = None,
    client: list[dict] | None = None,
) -> dict:
    """Poisson arrivals at each rate, `seconds` of them, against one server and (the client's ceiling) against
    benchmarks.mock_server, interleaved; then the burst on the same server. Stops after two rates in a row miss
    the SLOs (the server is past saturation). Writes sweep.json and sweep.png. base_root: the server is that
    checkout's launch.py, its files and labels named base_; client: the client's points taken already (no
    mock-server runs)."""
    from benchmarks.serve import ROOT, LaunchedServer

    tag = "base_" if base_root is not None else ""
    points: list[dict] = []
    measure_client = client is None
    client = [] if client is None else client
    burst_tok_s = None
    with LaunchedServer(launch, str(out / f"{tag}sweep_server.log"), root=base_root or ROOT) as srv:
        for rate in rates:
            n = max(256, int(rate * seconds))
            flags = (
                f"--model {model} --num-requests {n} --input-len-range 64-512 --output-len-range 16-256 "
                f"--request-rate {rate} --seed {int(rate)} --client-processes {clients}"
            )
            if measure_client:
                mocked = serve(f"sweep_client_{rate:g}", f"--mock-server {mock} {flags}", out, log, rows)
                if mocked is not None:
                    client.append(sweep_point(rate, mocked))
            result = serve(f"{tag}sweep_{rate:g}", f"--url {srv.url} {flags}", out, log, rows)
            if result is not None:
                points.append(sweep_point(rate, result))
            if len(points) >= 2 and not slo.met(points[-1]) and not slo.met(points[-2]):
                break
        burst_flags = f"--url {srv.url} --model {model} {BURST} --client-processes {clients}"
        burst = serve(f"{tag}sweep_burst", burst_flags, out, log, rows)
        if burst is not None:
            burst_tok_s = burst["summary"]["completion_throughput"]
    verdict = goodput(points, client, burst_tok_s, slo)
    verdict["server"] = launch
    if base_root is not None:
        verdict["root"] = str(base_root)
    (out / f"{tag}sweep.json").write_text(json.dumps(verdict, indent=1))
    from benchmarks.plots import write_sweep_plot

    write_sweep_plot(verdict, out / f"{tag}sweep.png", f"Poisson sweep: python launch.py {launch}")
    g = verdict["goodput_point"]
    print(
        f"{tag}goodput: {verdict['goodput_req_s']:g} req/s "
        f"(TTFT p99 <= {slo.ttft_ms:g} ms, ITL p99 <= {slo.itl_ms:g} ms)"
        + (f", {g['tok_s']:,.0f} tok/s there" if g else "")
        + ("; the client may be the limit (see client_points)" if verdict["client_limited"] else "; not client-limited")
        + f"; saturation {verdict['saturation_tok_s']:,.0f} tok/s = "
        + (f"{100 * verdict['saturation_of_burst']:.0f}% of the burst's {burst_tok_s:,.0f}" if burst_tok_s else "?"),
        flush=True,
    )
    return verdict


def table(rows: list[dict]) -> str:
    lines = [
        "| run | completion tok/s | failed | TTFT p50 / p99 (ms) | ITL p99 (ms) | step period (ms) "
        "| client (processes × peak CPU) | busy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        itl = "-" if r["itl_p99_ms"] is None else f"{r['itl_p99_ms']:.1f}"
        step = "-" if r.get("step_ms") is None else f"{r['step_ms']:.2f}"
        lines.append(
            f"| {r['label']} | {r['tok_s']:,.0f} | {r['failed']} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
            f"{itl} | {step} | {r['client']} | {r['busy']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a model folder (random weights are used)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--parts", default="ceilings,w1,burst,sweep")
    parser.add_argument("--api-server-counts", default="1,2,4")
    parser.add_argument("--client-processes", type=int, default=default_client_processes())
    parser.add_argument("--mock-processes", type=int, default=8)
    parser.add_argument("--base-root", help="another checkout whose launch.py is the 'before' server")
    parser.add_argument("--tensor-parallel-sizes", default="1,2", help="parallel: W1 with each")
    parser.add_argument("--data-parallel-sizes", default="1,2", help="parallel: the burst with each")
    parser.add_argument("--repeats", type=int, default=2, help="parallel: rounds of the sizes, interleaved")
    parser.add_argument("--server-flags", default="", help="more flags for every server this runs")
    parser.add_argument("--sweep-rates", default=SWEEP_RATES, help="sweep: Poisson rates, requests/s")
    parser.add_argument("--sweep-seconds", type=float, default=8.0, help="sweep: seconds of arrivals at each rate")
    parser.add_argument("--slo-ttft-ms", type=float, default=200.0, help="sweep: goodput's TTFT p99 bound")
    parser.add_argument("--slo-itl-ms", type=float, default=50.0, help="sweep: goodput's ITL p99 bound")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "commands.log"
    m, p = str(Path(args.model).resolve()), args.client_processes  # absolute: --launch-root runs elsewhere
    counts = [int(k) for k in args.api_server_counts.split(",")]
    parts = args.parts.split(",")
    rows: list[dict] = []
    dummy = f"--model {m} --load-format dummy {args.server_flags}".strip()
    if "ceilings" in parts:
        serve(
            "client_ceiling_mock",
            f"--mock-server {args.mock_processes} --model {m} {BURST} --client-processes {p}",
            out,
            log,
            rows,
        )
        serve(
            "serving_ceiling_null",
            f"--launch '--model {m} --load-format null --api-server-count {max(counts)}' "
            f"{BURST} --client-processes {p}",
            out,
            log,
            rows,
        )
    if "w1" in parts:
        offline("w1_engine", f"{dummy} {W1_OFFLINE}", out, log, rows)
        if args.base_root:
            serve(
                "w1_server_base",
                f"--launch '{dummy}' --launch-root {args.base_root} {W1} --client-processes {p}",
                out,
                log,
                rows,
            )
        for k in counts:
            serve(
                f"w1_server_k{k}",
                f"--launch '{dummy} --api-server-count {k}' {W1} --client-processes {p}",
                out,
                log,
                rows,
            )
    if "burst" in parts:
        offline("burst_engine", f"{dummy} {BURST_OFFLINE}", out, log, rows)
        for k in counts:
            flags = f"--launch '{dummy} --api-server-count {k}' {BURST} --client-processes {p}"
            serve(f"burst_server_k{k}", flags, out, log, rows)
    if "sweep" in parts:
        rates = [float(r) for r in args.sweep_rates.split(",")]
        launch = f"{dummy} --api-server-count {max(counts)}"
        slo = Slo(args.slo_ttft_ms, args.slo_itl_ms)
        ours = sweep(m, launch, p, args.mock_processes, rates, args.sweep_seconds, slo, out, log, rows)
        if args.base_root:  # the same rates against the 'before' checkout, the client's points reused
            base = Path(args.base_root).resolve()
            sweep(m, launch, p, 0, rates, args.sweep_seconds, slo, out, log, rows, base, ours["client_points"])
    if "parallel" in parts:
        k = max(counts)
        for rep in range(1, args.repeats + 1):
            for tp in (int(x) for x in args.tensor_parallel_sizes.split(",")):
                flags = f"--launch '{dummy} --api-server-count {k} -tp {tp}' {W1} --client-processes {p}"
                serve(f"w1_tp{tp}_{rep}", flags, out, log, rows)
            for dp in (int(x) for x in args.data_parallel_sizes.split(",")):
                launch = f"{dummy} --api-server-count {k} -dp {dp} --max-num-seqs 256"
                serve(f"burst_dp{dp}_{rep}", f"--launch '{launch}' {BURST} --client-processes {p}", out, log, rows)
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    text = table(rows)
    (out / "table.md").write_text(text + "\n\n" + "\n".join(f"- {r['label']}: `{r['command']}`" for r in rows) + "\n")
    print(text)


if __name__ == "__main__":
    main()
