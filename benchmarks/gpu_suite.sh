#!/usr/bin/env bash
# Runs on a CUDA machine with >= 2 GPUs: every GPU test, then epcomm-bench (core and collectives suites).
# Logs and JSON land under $OUT (or ./gpu_out); each step has its own time limit so one hang costs one step.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:${PYTHONPATH:-}"
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
{ python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.nccl.version(), torch.cuda.get_device_name())'
  nvidia-smi topo -m; } > "$OUT/env.txt" 2>&1
step() {  # step NAME SECONDS CMD...: run CMD with a limit, keep the last lines in $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s)"; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  tail -25 "$OUT/$name.log"; echo "== $name rc=$rc in $((SECONDS - t0))s"
}
if [ -z "${SKIP_TESTS:-}" ]; then
  step gpu_tests "${TEST_TIMEOUT:-420}" python3 -m pytest -m "multigpu or gpu" -q -p no:cacheprovider tests/ ${PYTEST_ARGS:-}
fi
step bench "${BENCH_TIMEOUT:-200}" python3 -m epcomm.bench ${BENCH_ARGS:-} --json "$OUT/bench.json"
if [ -z "${SKIP_COLLECTIVES:-}" ]; then
  step collectives "${COLL_TIMEOUT:-120}" python3 -m epcomm.bench --suite collectives --json "$OUT/collectives.json"
fi
