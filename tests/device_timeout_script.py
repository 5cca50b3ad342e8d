"""Two GPU ranks; rank 1 never makes the second call, so rank 0's device-side wait must end after
`num_gpu_timeout_secs`, print the missing rank and abort the kernel (run by tests/test_gpu.py and
tests/test_lowlatency.py); or a send kernel must stop on a bad expert id (tests/test_device_id_checks.py).
`python device_timeout_script.py PORT CALL`, CALL one of:
- `low-latency`: `low_latency_dispatch` (the low-latency kernels' flags);
- `sync-free`: `dispatch(do_cpu_sync=False)` on the nvlink transport (the device barrier of its region);
- `sync-free-bad-id`: both ranks make the second call, rank 0's with an expert id equal to num_experts: its fused
  send kernel must name the token and abort;
- `low-latency-bad-id`: the same with `low_latency_dispatch`.
The bad-id cases run on one GPU as well (one rank).
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def body(rank: int, world: int, port: int, call: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    import epcomm

    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=8, hidden=256, num_gpu_timeout_secs=2, transport="nvlink")
    x = torch.randn(8, 256, device="cuda").bfloat16()
    idx = torch.rand(8, 8).topk(2, dim=1).indices.cuda()

    def make_call():
        if call.startswith("low-latency"):
            buf.low_latency_dispatch(x, idx, 8, 8)
        else:
            buf.dispatch(x, topk_idx=idx, num_experts=8, do_cpu_sync=False)

    make_call()  # both ranks (the low-latency region is allocated collectively)
    torch.cuda.synchronize()
    dist.barrier()
    if call.endswith("bad-id"):
        if rank == 0:
            idx[3, 1] = 8
        make_call()
        torch.cuda.synchronize()
        print(f"rank {rank}: NO ERROR", flush=True)
    elif rank == 0:
        make_call()
        torch.cuda.synchronize()  # the aborted kernel surfaces here as a CUDA error
        print("rank 0: NO ERROR", flush=True)
    else:
        time.sleep(30)  # never makes the call
    os._exit(0)


def run_aborting(call: str, port: int) -> str:
    """Run this script for `call` in a fresh interpreter (an aborted kernel takes its process down); check that it
    failed, and return its output."""
    import subprocess
    from pathlib import Path

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run([sys.executable, str(Path(__file__)), str(port), call], capture_output=True, env=env,
                         timeout=180)
    out = res.stdout.decode() + res.stderr.decode()
    assert res.returncode != 0 and "rank 0: NO ERROR" not in out, out[-3000:]
    return out


def check_timeout_names_rank_1(call: str, port: int) -> None:
    """Rank 0 failed with the device-side message naming rank 1 (used by the GPU tests)."""
    out = run_aborting(call, port)
    assert "timed out waiting for rank: 1" in out, out[-3000:]


if __name__ == "__main__":
    world = min(2, torch.cuda.device_count()) if sys.argv[2].endswith("bad-id") else 2
    mp.spawn(body, args=(world, int(sys.argv[1]), sys.argv[2]), nprocs=world)
