"""One request of 128 tokens in process (offline.LLM, the default model), three times, under the OpenMP settings of
its environment: env OMP_WAIT_POLICY=P GOMP_SPINCOUNT=N OMP_NUM_THREADS=2 python docs/results/cpu_spin_2cores/offline_spin.py"""

import os
import time

import torch

from common.sampling_params import SamplingParams
from offline import LLM

llm = LLM()
sp = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
p = "Write a short poem about the sea."
llm.generate([p], SamplingParams(max_tokens=8, temperature=0.0))

res = []
for _ in range(3):
    t = time.time()
    llm.generate([p], sp)
    res.append(128 / (time.time() - t))
print(
    os.environ.get("OMP_WAIT_POLICY"),
    os.environ.get("GOMP_SPINCOUNT"),
    "threads",
    torch.get_num_threads(),
    "tok/s",
    [round(r, 1) for r in res],
)
llm.close()
