"""Two CPU ranks (gloo); rank 1's process exits after the first dispatch without an error of its own on record, as a
killed or crashed process would. Rank 0's second dispatch must raise PeerFailed at once (the process group's
connection to the peer failed), then refuse the next call. With WHAT=barrier rank 0 calls a BucketBuffer's barrier
twice and destroys it (the barrier too raises PeerFailed, then refuses; destroy is local). Run by
tests/test_errors.py: `python peer_exit_script.py PORT RANK [WHAT]`; rank 0 prints one line per outcome."""

import os
import sys
import time

import torch
import torch.distributed as dist


def main(port: int, rank: int, what: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    import epcomm

    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=16, hidden=32, num_topk=2, num_cpu_timeout_secs=30)
    bucket = epcomm.BucketBuffer(None, 2 << 20, explicitly_destroy=True, num_cpu_timeout_secs=30)
    gen = torch.Generator().manual_seed(rank)
    x, idx = torch.randn(8, 32, generator=gen), torch.rand(8, 4, generator=gen).topk(2, dim=1).indices
    buf.dispatch(x, idx, num_experts=4)
    if rank == 1:
        os._exit(3)
    start = time.monotonic()
    calls = [bucket.barrier, bucket.barrier, bucket.destroy] if what == "barrier" else \
        [lambda: buf.dispatch(x, idx, num_experts=4)] * 2
    for call in calls:
        try:
            call()
            print("no error", flush=True)
        except Exception as e:  # noqa: BLE001 (the outcome is what the test checks)
            print(f"{type(e).__name__} after {time.monotonic() - start:.1f} s: {e}", flush=True)
    os._exit(0)  # the group holds a collective that will not complete


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "dispatch")
