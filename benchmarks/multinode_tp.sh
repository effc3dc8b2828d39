#!/usr/bin/env bash
# Tensor parallelism across nodes, checked on one host with two GPUs: W1 through the server at TP=1 (one GPU),
# TP=2 on one node (one launcher, its rank 1 fed by a local socket), and TP=2 as two "nodes" (two launchers, one
# GPU each by CUDA_VISIBLE_DEVICES, rank 1 fed by the gloo broadcast, NCCL and the rendezvous over loopback).
# Prints each run's decode step (ITL as sampled on the GPU worker, p50), TPOT p50 and completion tokens/s, then
# checks that node 1 stopped cleanly with node 0.
#
#     benchmarks/multinode_tp.sh MODEL_FOLDER [OUT_DIR]        # e.g. .device-cache/smollm2 /tmp/multinode_tp
#
# Every run: --load-format dummy (the same random model at every TP size), the default dtype (bfloat16). A smoke
# run on a CPU: EXTRA="--device cpu --dtype float32" W1="--num-requests 4 --input-len-range 8-16 --max-new-tokens 8".
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:?usage: benchmarks/multinode_tp.sh MODEL_FOLDER [OUT_DIR]}
OUT=${2:-/tmp/multinode_tp}
mkdir -p "$OUT"
ENGINE="--model $MODEL --load-format dummy ${EXTRA:-}"  # --model: benchmarks.serve reads the vocabulary from it
W1="${W1:---num-requests 256 --input-len-range 64-512 --max-new-tokens 256} --no-stop-on-eos"
PORT=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
NODES="-tp 2 --nnodes 2 --master-addr 127.0.0.1 --master-port $PORT"

serve() {  # LABEL LAUNCH_ARGS
    python -m benchmarks.serve --launch "$2" $W1 --label "$1" --output-json "$OUT/$1.json" \
        --server-log "$OUT/$1.server.log" > "$OUT/$1.txt"
}

CUDA_VISIBLE_DEVICES=0 serve tp1 "$ENGINE"
CUDA_VISIBLE_DEVICES=0,1 serve tp2_one_node "$ENGINE -tp 2"
# Node 1 first: it waits for node 0 (up to 300 s), and stops, exit code 0, when node 0 stops on request.
CUDA_VISIBLE_DEVICES=1 python launch.py $ENGINE $NODES --headless --node-rank 1 > "$OUT/tp2_two_nodes.node1.log" 2>&1 &
NODE1=$!
trap 'kill $NODE1 2> /dev/null || true' EXIT
CUDA_VISIBLE_DEVICES=0 serve tp2_two_nodes "$ENGINE $NODES"
wait $NODE1 && echo "node 1 stopped with node 0 (exit code 0)" || echo "node 1 exited with $? (see $OUT/tp2_two_nodes.node1.log)"

python - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
print(f"{'run':<16}{'decode step p50 ms':>20}{'TPOT p50 ms':>14}{'completion tok/s':>18}")
for label in ("tp1", "tp2_one_node", "tp2_two_nodes"):
    s = json.loads((out / f"{label}.json").read_text())["summary"]
    ms = s["latencies_ms"]
    print(f"{label:<16}{ms['itl_sampled']['p50']:>20.2f}{ms['tpot']['p50']:>14.2f}{s['completion_throughput']:>18,.0f}")
EOF
