#!/usr/bin/env bash
# The GPU checks of a session, in one call on a lent GPU machine (the device tool runs it from
# the repository root with OUT set): Triton kernels against their twins, the compressor table,
# every pipeline's device path under CUDA's sync debug mode, and the DDP step table. Each part
# has a time limit and writes into $OUT as it goes; the default five parts' limits add up to
# 870 s, more than one 10-minute call of the device tool, so run them as two calls:
# `kernels ddp sync compressors` (570 s at most), then `STEPS_LIMIT=<seconds left> steps`.
#
#   bash scripts/gpu_checks.sh [kernels] [compressors] [sync] [ddp] [steps] [profile] [calls]
#                              [stepprofile] [selection]
#          (default: the first five; ddp: the hook and DistCollectives on NCCL,
#           tests/workers/ddp_cuda.py; profile: benchmarks/gpu_profile.py; calls: the DDP
#           hook's Python calls per step on CUDA tensors, benchmarks/hook_calls.py;
#           stepprofile: where a step's time goes, grace's hook against PyTorch's,
#           benchmarks/gpu_step_profile.py; selection: the radix select against torch.topk
#           from 1M to 64M elements, to set select.RADIX_MIN)
set -u
OUT="${OUT:-/tmp/grace_dl_gpu}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(kernels compressors sync ddp steps)
log="$OUT/run.log"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} >>"$log" 2>&1
for part in "${parts[@]}"; do
  echo "== $part $(date -u +%T)" >>"$log"
  case "$part" in
    kernels) timeout 150 python3 tests/kernel_checks.py cuda >>"$log" 2>&1 ;;
    compressors) timeout 150 python3 -m benchmarks.gpu compressors --out "$OUT" --repeats 20 \
                   >>"$log" 2>&1 ;;
    sync) GRACE_DL_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider -rf \
            --tb=short ${SYNC_K:+-k "$SYNC_K"} \
            tests/test_device_path.py >"$OUT/device_path.log" 2>&1 ;;
    ddp) timeout 120 torchrun --standalone --nproc-per-node 1 tests/workers/ddp_cuda.py nccl \
           >>"$log" 2>&1 ;;
    steps) timeout "${STEPS_LIMIT:-300}" python3 -m benchmarks.gpu steps --out "$OUT" --steps 15 \
             >>"$log" 2>&1 ;;
    profile) timeout 120 python3 -m benchmarks.gpu_profile --out "$OUT" --calls 10 \
               --methods ${PROFILE_METHODS:-qsgd signsgd signum topk randomk dgc threshold adaq sketch inceptionn} \
               >>"$log" 2>&1 ;;
    calls) timeout 120 python3 -m benchmarks.hook_calls --device cuda --id cuda \
             --json "$OUT/hook_calls.json" >>"$log" 2>&1 ;;
    stepprofile) timeout "${STEPPROFILE_LIMIT:-240}" python3 -m benchmarks.gpu_step_profile \
                   --out "$OUT" --steps 5 >>"$log" 2>&1 ;;
    selection) timeout 120 python3 -m benchmarks.gpu_profile --out "$OUT" --calls 20 \
                 --selection 1M 2M 4M 8M 16M 64M >>"$log" 2>&1 ;;
    *) echo "unknown part $part" >>"$log" ;;
  esac
  echo "== $part done rc=$? $(date -u +%T)" >>"$log"
done
tail -n 5 "$OUT/device_path.log" 2>/dev/null
grep -E "^== |kernels equal|^FAIL|Error|error" "$log" | tail -n 40
