"""The setup shared by benchmarks/return_sweep.py and benchmarks/graph_timeline.py: one rank's NCCL group, an nvlink
buffer, dsv3 inputs (4096 tokens per rank, hidden 7168, 256 experts, top-8, uniform routing: scores |randn| + 1)
and the CPU-synced handle of their non-expand BF16 dispatch, whose cached dispatch and combine those scripts time."""

import os

import torch
import torch.distributed as dist

TOKENS, HIDDEN, NUM_EXPERTS, NUM_TOPK = 4096, 7168, 256, 8


def start(rank: int, world: int, port: int) -> tuple:
    """Returns `(buf, x, handle, y)`: the buffer, this rank's tokens [T, H] bf16, the handle, and expert outputs
    [M, H] bf16 in the handle's layout (the received rows times 1.5)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    import epcomm

    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=TOKENS, hidden=HIDDEN, num_topk=NUM_TOPK,
                          explicitly_destroy=True, transport="nvlink")
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).bfloat16().cuda()
    topk_idx = (torch.randn(TOKENS, NUM_EXPERTS, generator=gen).abs() + 1).topk(NUM_TOPK, dim=1).indices.cuda()
    recv_x, _, _, handle, _ = buf.dispatch(x, topk_idx, num_experts=NUM_EXPERTS)
    return buf, x, handle, (recv_x.float() * 1.5).bfloat16()
