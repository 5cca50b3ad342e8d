#!/usr/bin/env bash
# A/B of the low-latency kernels across source trees, alternating on one machine (eager and replay times drift
# between machines, so only same-machine pairs compare): benchmarks/lowlatency_sweep.py's default shape, per call in
# a CUDA graph of 8, T=128.
#
# Usage (repository root, on the GPU machine; the trees are exported beforehand where git works):
#   for c in e5c36eb 7c13a54; do mkdir -p trees/$c && git archive $c src | tar -x -C trees/$c; done
#   RANKS=2 ROUNDS=2 bash benchmarks/tree_ab.sh trees/e5c36eb trees/7c13a54 .
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export EPCOMM_LL_SWEEP=default EPCOMM_LL_SWEEP_RANKS=${RANKS:-2}
for round in $(seq "${ROUNDS:-2}"); do
  for tree in "$@"; do
    line=$(PYTHONPATH="$tree/src" timeout 120 python benchmarks/lowlatency_sweep.py 2>&1 | grep -E 'T=128|Error' | tail -2)
    echo "round $round $tree: ${line#*SM=2: }"
  done
done
