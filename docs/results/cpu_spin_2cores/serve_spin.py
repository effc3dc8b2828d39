"""The default model served on this CPU, one idle-thread spin count: three requests of 128 tokens one after the
other, then 16 at once (a fresh server each run). From the repo root: python docs/results/cpu_spin_2cores/serve_spin.py
SPINCOUNT ("0": idle threads sleep at once, as before the change; "none": the launcher's own choice)."""

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx

env = dict(os.environ)
spin = sys.argv[1]
if spin != "none":
    env["GOMP_SPINCOUNT"] = spin
proc = subprocess.Popen(
    [sys.executable, "launch.py", "--port", "8751"],
    env=env,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
    start_new_session=True,
)
try:
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            if httpx.get("http://127.0.0.1:8751/health").status_code == 200:
                break
        except Exception:
            pass
        time.sleep(1)
    time.sleep(8)  # the grammar vocabulary preparation (idle cycles) out of the way

    def body(n):
        return {
            "messages": [{"role": "user", "content": f"{n} Write a short poem about the sea."}],
            "temperature": 0,
            "max_tokens": 128,
            "ignore_eos": True,
        }

    httpx.post("http://127.0.0.1:8751/v1/chat/completions", json=body(0), timeout=120)
    single = []
    for i in range(3):
        t = time.time()
        httpx.post("http://127.0.0.1:8751/v1/chat/completions", json=body(i + 1), timeout=120)
        single.append(128 / (time.time() - t))

    async def burst(n):
        async with httpx.AsyncClient(timeout=300) as c:
            t = time.time()
            await asyncio.gather(
                *(c.post("http://127.0.0.1:8751/v1/chat/completions", json=body(100 + i)) for i in range(n))
            )
            return n * 128 / (time.time() - t)

    b16 = asyncio.run(burst(16))
    print(f"spin {spin}: single {[round(s, 1) for s in single]} tok/s; 16 at once {b16:.1f} tok/s", flush=True)
finally:
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(60)
