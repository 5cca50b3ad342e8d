#!/usr/bin/env bash
# Runs on a CUDA machine with >= 2 GPUs: GPU tests, then epcomm-bench, logs and JSON under $OUT (or ./gpu_out).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:${PYTHONPATH:-}"
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.nccl.version(), torch.cuda.get_device_name())' | tee "$OUT/env.txt"
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -m multigpu -q -x tests/test_gpu.py ${PYTEST_ARGS:-} 2>&1 | tail -40 | tee "$OUT/gpu_tests.log"
timeout "${BENCH_TIMEOUT:-240}" python3 -m epcomm.bench ${BENCH_ARGS:-} --json "$OUT/bench.json" 2>&1 | tail -60 | tee "$OUT/bench.log"
