#!/usr/bin/env bash
# `make demo`: train examples/pytorch_digits.py on 2 processes (horovodrun) without compression
# and with top-k 1% + residual error feedback + allgather, then print a comparison table.
# Then, as root (network namespaces), time the same pipelines and Horovod's fp16 on a 5.8M-
# parameter model over an emulated 100 Mbit/s link, where compression pays
# (benchmarks/demo_link.py); without root it prints one line saying why it skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
# PYTHONPATH: the scripts import this checkout's grace_dl, whatever the venv has installed.
# horovodrun imports TensorFlow to list the frameworks it was built with: TF_CPP_MIN_LOG_LEVEL
# and TF_ENABLE_ONEDNN_OPTS=0 keep its start-up notices off the screen (no TF model runs here).
export PATH="$PWD/.venv/bin:$PATH" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" \
    OMP_NUM_THREADS=1 TF_CPP_MIN_LOG_LEVEL=3 TF_ENABLE_ONEDNN_OPTS=0
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

run() {  # name, then pytorch_digits.py flags
    local name=$1; shift
    echo "== $name =="
    # Same epochs, learning rate and seed for both runs: error feedback needs a few epochs
    # to catch up with uncompressed training (at 8 epochs top-k 1% trails by ~7 points).
    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_digits.py \
        --epochs 20 --lr 0.1 --json-out "$out/$name.json" "$@"
}
run none --compressor none --memory none --communicator allreduce
run topk --compressor topk --memory residual --communicator allgather --compress-ratio 0.01

python - "$out/none.json" "$out/topk.json" <<'PY'
import json, sys
rows = [("none", "no compression, allreduce"), ("topk", "top-k 1% + residual, allgather")]
results = {name: json.load(open(path)) for (name, _), path in zip(rows, sys.argv[1:])}
base = results["none"]["bytes_sent_per_step"]
print()
print(f"{'pipeline':34} {'accuracy':>9} {'bytes sent/step':>16} {'vs none':>8} {'step ms':>8}")
for name, label in rows:
    r = results[name]
    print(f"{label:34} {r['accuracy']:9.4f} {r['bytes_sent_per_step']:16,.0f} "
          f"{base / r['bytes_sent_per_step']:7.1f}x {r['step_time_ms']:8.2f}")
print(f"\n2 ranks, {results['none']['steps']} steps each; bytes are what rank 0 put on the wire "
      f"per optimizer step (fp32 gradients: {results['none']['dense_bytes']:,} bytes).")
PY

echo
python -m benchmarks.demo_link --mbit 100
