"""The pull's one-launch gather (`transport/pull.gather_in_one_launch`) under TRITON_INTERPRET=1 against the
per-field `index_select`s it replaces: staged rows and own rows of up to four fields of mixed widths (BF16 rows
wider than a program's block, FP8 rows, fp32 scales, fp64 weights, int64 routing rows), a rank that stages nothing,
a rank with no rows for itself, and no send rows at all; the barrier the gather runs after itself (its last
program only, once per launch: ranks simulated as in barrier_sim.py, each rank's gather with the signal half, then
every rank's wait half); and the SMs' copy of narrow fields out of a peer (`copy_by_sms`). Run as a script:
`python gather_sim.py CASE`."""

import sys

import torch

from epcomm.kernels._signal_triton import barrier
from epcomm.moves import Route
from epcomm.transport.pull import PullPlan, copy_by_sms, gather_in_one_launch, pull_weights

FLAGS_OFF = 256  # the barrier's flags follow other bytes of the region, as in SymmetricRegion


def fields(gen, rows, kinds):
    out = []
    for kind in kinds:
        if kind == "bf16-wide":
            out.append(torch.randn(rows, 2056, generator=gen).bfloat16())
        elif kind == "fp8":
            out.append(torch.randn(rows, 128, generator=gen).to(torch.float8_e4m3fn))
        elif kind == "sf":
            out.append(torch.rand(rows, 3, generator=gen))
        elif kind == "w64":
            out.append(torch.rand(rows, 5, generator=gen).double())
        elif kind == "routing":
            out.append(torch.randint(-1, 100, (rows, 9), generator=gen))
    return out


def check(me, matrix, kinds, seed=0, sync=None):
    gen = torch.Generator().manual_seed(seed)
    num_ranks = len(matrix)
    send_splits = matrix[me]
    recv_splits = [row[me] for row in matrix]
    num_tokens = max(sum(send_splits), 1) + 3
    src_X = torch.randint(0, num_tokens, (sum(send_splits),), generator=gen)
    route = Route(send_splits, recv_splits, src_X, matrix)
    plan = PullPlan(route, me, num_ranks, torch.device("cpu"))
    srcs = fields(gen, num_tokens, kinds)
    lo = sum(recv_splits[:me])
    staged_rows = plan.staged_rows[me]

    def fresh(template, rows):
        return torch.zeros((rows,) + tuple(template.shape[1:]), dtype=template.dtype)

    want_out = [fresh(s, route.num_recv) for s in srcs]
    want_stage = [fresh(s, staged_rows) for s in srcs]
    for src, out, stage in zip(srcs, want_out, want_stage):
        staged = torch.cat([plan.send_idx[:plan.own_rows[0]], plan.send_idx[plan.own_rows[1]:]])
        stage.view(torch.uint8).copy_(src.view(torch.uint8)[staged])
        out.view(torch.uint8)[lo: lo + len(plan.self_idx)] = src.view(torch.uint8)[plan.self_idx]
    got_out = [fresh(s, route.num_recv) for s in srcs]
    got_stage = [fresh(s, staged_rows) for s in srcs]
    row_bytes = [s[0].numel() * s.element_size() for s in srcs]
    ran = gather_in_one_launch(plan, list(zip(srcs, got_out)), row_bytes, got_stage if staged_rows else None, lo,
                               sync)
    assert ran == (sync is not None and plan.send_idx.shape[0] > 0), ran
    for name, a, b in (("out", want_out, got_out), ("stage", want_stage, got_stage)):
        for kind, u, v in zip(kinds, a, b):
            assert torch.equal(u.view(torch.uint8), v.view(torch.uint8)), f"{name} {kind} differs"


CASES = {
    "four-fields": (1, [[3, 4, 2], [5, 6, 1], [0, 2, 7]], ("bf16-wide", "sf", "w64", "routing")),
    "fp8-two-fields": (0, [[4, 3], [2, 5]], ("fp8", "sf")),
    "stages-nothing": (1, [[2, 3], [0, 6]], ("routing", "bf16-wide")),
    "nothing-for-itself": (0, [[0, 5, 2], [1, 1, 1], [3, 0, 0]], ("w64",)),
    "no-send-rows": (2, [[1, 1, 0], [0, 2, 0], [0, 0, 0]], ("bf16-wide", "sf")),
    "copy-words": None,  # check_copy_words
}
BARRIER_CASES = {
    "barrier-three-ranks": ([[3, 4, 2], [5, 6, 1], [0, 2, 7]], ("bf16-wide", "sf")),
    "barrier-one-rank": ([[6]], ("routing", "fp8")),
}


def regions(num_ranks):
    """Every rank's region (flags after FLAGS_OFF bytes), its 16-byte deltas to the others, status and counter."""
    areas = [torch.zeros(FLAGS_OFF + 256, dtype=torch.uint8) for _ in range(num_ranks)]
    ptrs = torch.tensor([t.data_ptr() for t in areas], dtype=torch.int64)
    return [dict(local=a, delta16=torch.div(ptrs - ptrs[r], 16, rounding_mode="floor"),
                 status=torch.zeros(1, dtype=torch.int64), done=torch.zeros(1, dtype=torch.int64))
            for r, a in enumerate(areas)]


def barrier_args(reg, me, num_ranks, wait):
    """`SymmetricRegion.barrier_in_kernel`'s dict for a simulated rank: the signal half only unless `wait`."""
    return dict(done_ptr=reg["done"], local_ptr=reg["local"], delta16_ptr=reg["delta16"],
                status_ptr=reg["status"].data_ptr(), me=me, timeout_ns=10**10, flags_off=FLAGS_OFF, R=num_ranks,
                R_POW2=1 << (num_ranks - 1).bit_length(), SIGNAL=True, WAIT=wait, USE_TIMER=False)


def flags(reg, num_ranks):
    return reg["local"][FLAGS_OFF:].view(torch.int64)[:num_ranks + 1].tolist()


def check_barrier(matrix, kinds, seed=0):
    """Each rank gathers with the barrier's signal half inside (one rank alone: both halves), then every rank runs
    the barrier kernel's wait half; twice, so the counter of finished programs is back at zero after a launch."""
    num_ranks = len(matrix)
    regs = regions(num_ranks)
    for b in (1, 2):
        for me in range(num_ranks):
            check(me, matrix, kinds, seed=seed + me + b, sync=barrier_args(regs[me], me, num_ranks, num_ranks == 1))
            assert regs[me]["done"].item() == 0
        if num_ranks > 1:
            for me in range(num_ranks):
                barrier[(1,)](regs[me]["local"], regs[me]["delta16"], regs[me]["status"].data_ptr(), me, 10**10,
                              FLAGS_OFF, R=num_ranks, R_POW2=1 << (num_ranks - 1).bit_length(), SIGNAL=False,
                              WAIT=True, USE_TIMER=False, num_warps=1)
        for me in range(num_ranks):  # one arrival from every rank per barrier, whatever the number of programs
            assert flags(regs[me], num_ranks) == [b] * (num_ranks + 1), (b, me, flags(regs[me], num_ranks))
            assert regs[me]["status"].item() == 0


def check_copy_words(seed=0):
    """`copy_by_sms` (the SMs' pull of narrow fields) moves every byte of rows of any width in whole words, and
    nothing past them, at sizes around its program's block."""
    gen = torch.Generator().manual_seed(seed)
    for rows, width in ((0, 8), (1, 3), (37, 56), (700, 8), (1, 4096)):
        src = torch.rand(rows, width, generator=gen)
        dst = torch.rand(rows + 1, width, generator=gen)
        tail = dst[rows:].clone()
        copy_by_sms(src, dst[:rows])
        assert torch.equal(dst[:rows], src) and torch.equal(dst[rows:], tail), f"copy_words {rows}x{width}"


if __name__ == "__main__":
    assert pull_weights(1) == (1,)
    for name in sys.argv[1:] or list(CASES) + list(BARRIER_CASES):
        if name in BARRIER_CASES:
            check_barrier(*BARRIER_CASES[name], seed=len(name))
        elif CASES[name] is None:
            check_copy_words(seed=len(name))
        else:
            me, matrix, kinds = CASES[name]
            check(me, matrix, kinds, seed=len(name))
        print(name, "ok")
    print("ok")
