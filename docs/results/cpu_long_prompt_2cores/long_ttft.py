"""TTFT of one 2,141-token prompt (the default model, streamed completions, 4 tokens), three in a row, through a fresh
server of this checkout: python docs/results/cpu_long_prompt_2cores/long_ttft.py LABEL (from the repo root)."""

import os
import signal
import subprocess
import sys
import time

import httpx

proc = subprocess.Popen(
    [sys.executable, "launch.py", "--port", "8762"],
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
    start_new_session=True,
)
try:
    for _ in range(180):
        try:
            if httpx.get("http://127.0.0.1:8762/health").status_code == 200:
                break
        except Exception:
            pass
        time.sleep(1)
    time.sleep(8)
    text = " ".join(f"Sentence {i} is about the weather in a city far away." for i in range(150))
    out = []
    for n in range(3):
        t = time.time()
        first = None
        with httpx.stream(
            "POST",
            "http://127.0.0.1:8762/v1/completions",
            json={"prompt": f"{n} " + text, "max_tokens": 4, "temperature": 0, "stream": True},
            timeout=300,
        ) as s:
            for line in s.iter_lines():
                if line.startswith("data: ") and first is None:
                    first = time.time() - t
        out.append(round(first * 1000))
    print(sys.argv[1], "TTFT ms (2,141-token prompt):", out, flush=True)
finally:
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(60)
