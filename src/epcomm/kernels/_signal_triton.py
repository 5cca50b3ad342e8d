"""Triton helpers for flags in symmetric memory: peer addressing, bounded waits, and the group barrier.

Shared by every kernel that waits for a peer (the low-latency kernels, `transport.symm.SymmetricRegion.barrier`,
and the kernels that run the region's barrier inside themselves: the fused CPU-synced dispatch's `publish_rows`,
the pull's one-launch gather), and the device-side stop on a bad expert id of the calls that check no ids on the
host (the fused sync-free and the low-latency dispatch).
Flags are int64 counters that only grow, so a wait is `flag >= target` and nothing is ever cleaned. Every wait
is bounded: on timeout the kernel prints the missing rank, records it in host memory and (on GPU) traps
(docs/decisions.md, "Errors and timeouts").
"""

import triton
import triton.language as tl


@triton.jit
def _clock(USE_TIMER: tl.constexpr):
    if USE_TIMER:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                         pack=1)
    else:
        return tl.zeros([], dtype=tl.int64)


@triton.jit
def _region(local_ptr, delta16_ptr, rank):
    """uint8 pointer to `rank`'s region: `delta16 * 16` bytes from ours. Stating the distance in 16-byte units
    keeps every address provably 16-byte aligned, so row copies compile to 16-byte vector accesses."""
    return local_ptr + tl.load(delta16_ptr + rank) * 16


@triton.jit
def _wait(flag_ptr, target, peer, timeout_ns, status_ptr, USE_TIMER: tl.constexpr):
    """Spin until `*flag_ptr >= target` (acquire, system scope). On timeout: print, record `peer`, trap (GPU)."""
    value = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    if value < target:  # the clock is read only when the flag is not up yet
        start = _clock(USE_TIMER)
        spins = tl.zeros([], dtype=tl.int32)
        late = tl.zeros([], dtype=tl.int32)
        while (value < target) & (late == 0):
            value = tl.load(flag_ptr, volatile=True)
            spins += 1
            if USE_TIMER:
                elapsed = _clock(USE_TIMER) - start
            else:
                elapsed = spins.to(tl.int64) * 1000000  # the interpreter has no clock: count a millisecond per poll
            late = (elapsed > timeout_ns).to(tl.int32)
        value = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")  # what the flag covers is visible now
        if value < target:
            missing = peer + tl.zeros([], dtype=tl.int64)
            tl.device_print("epcomm device wait (num_gpu_timeout_secs): timed out waiting for rank", missing)
            status = status_ptr.to(tl.int64).to(tl.pointer_type(tl.int64))  # host memory, read unsynchronised
            tl.atomic_xchg(status, missing + 1, sem="relaxed", scope="sys")
            tl.atomic_add(status, 0, sem="relaxed", scope="sys")  # a read-back: the record lands before the trap
            if USE_TIMER:
                tl.inline_asm_elementwise("trap;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()  # the rows the flag covers are read by every thread of the program


@triton.jit
def _wait_all(flags_ptr, target, timeout_ns, status_ptr, R: tl.constexpr, R_POW2: tl.constexpr,
              USE_TIMER: tl.constexpr):
    """`_wait` for `flags_ptr[r] >= target`, every rank r < R (the flag of rank r is element r): one acquire read
    per rank, all in flight at once, rather than one round trip after another; a flag not up yet is then waited
    for rank by rank (bounded, naming the rank)."""
    r = tl.arange(0, R_POW2)
    value = tl.atomic_add(flags_ptr + r, tl.zeros([R_POW2], dtype=tl.int64), mask=r < R, sem="acquire", scope="sys")
    if tl.min(tl.where(r < R, value - target, 0), axis=0) < 0:
        for rank in tl.static_range(R):
            _wait(flags_ptr + rank, target, rank, timeout_ns, status_ptr, USE_TIMER)
    tl.debug_barrier()  # the rows the flags cover are read by every thread of the program


@triton.jit
def _wait_all_timed(flags_ptr, target, timeout_ns, status_ptr, cost_ptr, R: tl.constexpr, R_POW2: tl.constexpr,
                    USE_TIMER: tl.constexpr):
    """`_wait_all`, adding to `cost_ptr[r]` (int64) the nanoseconds this program waited for rank r's flag (the
    low-latency calls' `*_wait_recv_cost_stats`). The flags are polled together, so a rank is charged until its own
    flag is seen, not until an earlier rank's; a rank whose flag was up at once is charged nothing. Then `_wait`
    per rank gives the acquire read and, after a timeout, the message naming the missing rank."""
    r = tl.arange(0, R_POW2)
    value = tl.atomic_add(flags_ptr + r, tl.zeros([R_POW2], dtype=tl.int64), mask=r < R, sem="acquire", scope="sys")
    pending = (r < R) & (value < target)
    if tl.max(pending.to(tl.int32), axis=0) > 0:
        waited = pending
        start = _clock(USE_TIMER)
        cost = tl.zeros([R_POW2], dtype=tl.int64)
        spins = tl.zeros([], dtype=tl.int32)
        late = tl.zeros([], dtype=tl.int32)
        while (tl.max(pending.to(tl.int32), axis=0) > 0) & (late == 0):
            value = tl.load(flags_ptr + r, mask=pending, other=0, volatile=True)
            spins += 1
            if USE_TIMER:
                elapsed = _clock(USE_TIMER) - start
            else:
                elapsed = spins.to(tl.int64) * 1000000  # the interpreter has no clock: a millisecond per poll
            cost = tl.where(pending, elapsed, cost)
            pending = pending & (value < target)
            late = (elapsed > timeout_ns).to(tl.int32)
        tl.atomic_add(cost_ptr + r, cost, mask=waited, sem="relaxed", scope="gpu")
        for rank in tl.static_range(R):  # after a timeout: no second wait, the message at once
            _wait(flags_ptr + rank, target, rank, tl.where(late != 0, 0, timeout_ns), status_ptr, USE_TIMER)
    tl.debug_barrier()  # the rows the flags cover are read by every thread of the program


@triton.jit
def _stop_on_bad_ids(ids_k, t, num_experts, WHAT: tl.constexpr, TRAP: tl.constexpr):
    """For calls that read no expert ids on the host (that would synchronise): an id outside [-1, num_experts) among
    `ids_k` (token t's picks, -1 where none) prints WHAT and t and, with TRAP (on GPU), traps, so the call stops
    loudly (the process's CUDA context is lost) instead of dropping the pick (docs/decisions.md, "Errors and
    timeouts")."""
    bad = tl.sum(((ids_k < -1) | (ids_k >= num_experts)).to(tl.int32), axis=0)
    if bad > 0:
        tl.device_print(WHAT, t)
        if TRAP:
            tl.inline_asm_elementwise("trap;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _last_to_finish(counter_ptr, num_programs):
    """Every program calls this after its reads and writes; True in exactly one: the last (it resets the counter,
    so the next launch on the stream finds it at zero).

    GPU scope is enough: the counter orders this GPU's programs among themselves, and what the last one then
    publishes to peers goes out with a system-scope release, which carries the order on (the pull's gather: the
    region's barrier; the low-latency receives: `freed`, `_signal_all`). After a low-latency split send kernel's
    sends, the only reader of what the last program does (the call counter) is a later kernel on this GPU. A
    system-scope fence here would also wait for every program's NVLink stores, with a thousand programs on one
    counter (measured on 2x H200: 3-10 us per call at 128 tokens)."""
    tl.debug_barrier()  # every thread's reads and writes happen before this program's release below
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = done == num_programs - 1
    if last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit(do_not_specialize=["me", "timeout_ns", "flags_off"])
def barrier(local_ptr, delta16_ptr, status_ptr, me, timeout_ns, flags_off, R: tl.constexpr, R_POW2: tl.constexpr,
            SIGNAL: tl.constexpr, WAIT: tl.constexpr, USE_TIMER: tl.constexpr):
    """One program: `group_barrier`. `SIGNAL` / `WAIT` split the two halves for the CPU simulation of several ranks
    (the interpreter runs one rank at a time); on GPU both are set."""
    group_barrier(local_ptr, delta16_ptr, status_ptr, me, timeout_ns, flags_off, R, R_POW2, SIGNAL, WAIT, USE_TIMER)


@triton.jit
def group_barrier(local_ptr, delta16_ptr, status_ptr, me, timeout_ns, flags_off, R: tl.constexpr,
                  R_POW2: tl.constexpr, SIGNAL: tl.constexpr, WAIT: tl.constexpr, USE_TIMER: tl.constexpr):
    """The region's barrier, in one program (the `barrier` kernel, or a kernel that runs it inside itself). The area
    at `flags_off` holds R arrival counters (one per rank) and this rank's barrier count.

    Barrier number b = count + 1: add 1 to counter `me` of every rank (R threads, one release add each at system
    scope, in parallel: the writes this stream made before the barrier are visible to a peer that sees the add),
    then wait until every rank's counter here reaches b (acquire). Stream order puts the caller's earlier work
    before it and its later work after it; a kernel that wrote rows before it runs `tl.debug_barrier()` first.

    The wait-only half re-reads the count that the signal half stored from one thread: it starts with a block-wide
    sync, so that the halves may also be split inside one kernel (on GPU, kernels call it with both set).
    """
    flags = (local_ptr + flags_off).to(tl.pointer_type(tl.int64))
    if not SIGNAL:
        tl.debug_barrier()  # the signal half's store (one thread) is visible to every warp
    b = tl.load(flags + R) + 1
    if SIGNAL:
        tl.store(flags + R, b)
        r = tl.arange(0, R_POW2)
        peers = local_ptr + tl.load(delta16_ptr + r, mask=r < R, other=0) * 16 + flags_off
        tl.atomic_add(peers.to(tl.pointer_type(tl.int64)) + me, 1, mask=r < R, sem="release", scope="sys")
    else:
        b -= 1  # the signal half of this barrier already counted it
    if WAIT:
        _wait_all(flags, b, timeout_ns, status_ptr, R, R_POW2, USE_TIMER)
