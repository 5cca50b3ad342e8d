"""Rank-side tasks of `epcomm-bench`: the correctness gate and one measurement per provider.

Each task runs on every rank of a `epcomm.testing.WorkerPool` as `task(rank, world_size, ...)`, rebuilds its
inputs from the case (`cases.make_inputs`), and returns plain Python data: a mismatch message (gate) or the
rank's per-call times and byte counts (measurements). Collectives are issued in the same order on every rank;
comparisons happen only after the last collective, so a rank that finds a mismatch never leaves its peers
waiting.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .. import reference
from ..baselines import TorchNativeDispatcher, raw_all_to_all
from ..buffer import EPBuffer
from ..fp8 import per_token_cast_back
from .cases import Case, EpcommConfig, dedup_send_counts, make_inputs, random_like_rows
from .timing import Timer

BUFFER_TIMEOUT_S = 120  # a peer missing for this long fails the task instead of hanging the run
FAULTS = ("dispatch", "cached", "combine", "torch-native")  # test hook: corrupt one output on rank 0
PEER_COPY_BYTES = 256 * 1024 * 1024


def _device() -> torch.device:
    if "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _buffer(cfg: EpcommConfig) -> EPBuffer:
    moe = cfg.case.moe
    return EPBuffer(None, num_max_tokens_per_rank=cfg.case.tokens, hidden=moe.hidden, num_topk=moe.num_topk,
                    use_fp8_dispatch=cfg.case.is_fp8, transport=cfg.transport, explicitly_destroy=True,
                    num_cpu_timeout_secs=BUFFER_TIMEOUT_S)


def _rows(x) -> int:
    return (x[0] if isinstance(x, tuple) else x).shape[0]


def _own_rows(handle, rank: int) -> int:
    psum = handle.psum_num_recv_tokens_per_scaleup_rank.tolist()
    return psum[rank] - (psum[rank - 1] if rank else 0)


# ----------------------------------------------------------------------------------------------------------
# correctness
# ----------------------------------------------------------------------------------------------------------
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: Tensor) -> Tensor:
    return t if t.dtype == torch.bool else t.contiguous().view(_INT_OF_SIZE[t.dtype.itemsize])


def _value(t: Tensor, index: tuple):
    v = t[index].cpu()
    return v.float().item() if v.is_floating_point() else v.item()


def first_mismatch(name: str, actual: Optional[Tensor], expected: Optional[Tensor]) -> Optional[str]:
    """None when `actual` equals `expected` bit for bit (shape and dtype included), else what differs first."""
    if actual is None or expected is None:
        if actual is None and expected is None:
            return None
        return f"{name}: got {'None' if actual is None else 'a tensor'}, expected " \
               f"{'None' if expected is None else 'a tensor'}"
    if tuple(actual.shape) != tuple(expected.shape):
        return f"{name}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    if actual.dtype != expected.dtype:
        return f"{name}: dtype {actual.dtype}, expected {expected.dtype}"
    a, e = _bits(actual), _bits(expected)
    if torch.equal(a, e):
        return None
    diff = (a != e).nonzero()
    first = tuple(diff[0].tolist())
    return (f"{name}: {diff.shape[0]} of {a.numel()} elements differ; first at {list(first)}: got "
            f"{_value(actual, first)!r}, expected {_value(expected, first)!r}")


def _corrupt(t: Tensor) -> Tensor:
    """A copy of `t` with the lowest bit of its first element flipped (the gate's self-test)."""
    t = t.clone()
    _bits(t).view(-1)[0] ^= 1
    return t


def _split(name: str, x) -> list:
    if isinstance(x, tuple):
        return [(name + ".data", x[0]), (name + ".scales", x[1])]
    return [(name, x)]


def gate_epcomm(rank: int, world_size: int, cfg: EpcommConfig, fault: Optional[str] = None) -> Optional[str]:
    """Check epcomm against `epcomm.reference` for one configuration; None, or the first mismatch on this rank.

    Checked bitwise on fresh random inputs: non-cached dispatch (CPU sync) outputs, the token keys and
    per-expert counts of its handle, cached-dispatch outputs, and (BF16 cases) combine of random expert outputs
    with the weights carried back.
    """
    case, moe = cfg.case, cfg.case.moe
    device = _device()
    inp = make_inputs(case, rank, device)
    pairs = []
    try:
        buf = _buffer(cfg)
        try:
            recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(
                inp.x, inp.topk_idx, inp.topk_weights, num_experts=moe.num_experts, do_cpu_sync=True,
                do_expand=cfg.do_expand, num_sms=cfg.num_sms)
            c_x, c_idx, c_w, _, _ = buf.dispatch(inp.x, handle=handle, topk_weights=inp.topk_weights,
                                                 do_expand=cfg.do_expand, num_sms=cfg.num_sms)
            r_x, r_idx, r_w, r_h = reference.dispatch(inp.x, inp.topk_idx, inp.topk_weights, moe.num_experts,
                                                      num_max_tokens_per_rank=case.tokens, do_expand=cfg.do_expand)
            if not case.is_fp8:
                y = random_like_rows(case, rank, _rows(recv_x), moe.hidden, device, "gate-expert-out")
                out_x, out_w, _ = buf.combine(y, handle, topk_weights=recv_w, num_sms=cfg.num_sms)
                ref_x, ref_w = reference.combine(y, r_h, topk_weights=r_w)
        finally:
            buf.destroy()
    except Exception as exc:  # every rank raises together (epcomm's agreement) or times out
        return f"raised {type(exc).__name__}: {exc}"
    if rank == 0 and fault == "dispatch":
        recv_x = (_corrupt(recv_x[0]), recv_x[1]) if isinstance(recv_x, tuple) else _corrupt(recv_x)
    if rank == 0 and fault == "cached":
        c_x = (_corrupt(c_x[0]), c_x[1]) if isinstance(c_x, tuple) else _corrupt(c_x)
    pairs += [(n, a, e) for (n, a), (_, e) in zip(_split("dispatch recv_x", recv_x), _split("", r_x))]
    pairs += [("dispatch recv_topk_idx", recv_idx, r_idx), ("dispatch recv_topk_weights", recv_w, r_w),
              ("handle.recv_src_metadata[:, 0] (token keys)", handle.recv_src_metadata[:, 0].long(), r_h.recv_g),
              ("handle.num_unaligned_recv_tokens_per_expert", handle.num_unaligned_recv_tokens_per_expert.long(),
               torch.tensor(r_h.num_recv_per_expert, dtype=torch.int64, device=device))]
    pairs += [(n, a, e) for (n, a), (_, e) in zip(_split("cached dispatch recv_x", c_x), _split("", r_x))]
    pairs += [("cached dispatch recv_topk_idx", c_idx, r_idx), ("cached dispatch recv_topk_weights", c_w, r_w)]
    if not case.is_fp8:
        if rank == 0 and fault == "combine":
            out_x = _corrupt(out_x)
        pairs += [("combine combined_x", out_x, ref_x), ("combine combined_topk_weights", out_w, ref_w)]
    for name, actual, expected in pairs:
        msg = first_mismatch(name, actual, expected)
        if msg is not None:
            return f"rank {rank}: {msg}"
    return None


def gate_torch_native(rank: int, world_size: int, case: Case, fault: Optional[str] = None) -> Optional[str]:
    """Round trip of the torch-native baseline with identity experts against `sum_k w_k * x` computed directly.

    A wrong baseline would make every ratio meaningless, so it is gated too (bitwise: same fp32 products, same
    summation over the top-k axis).
    """
    moe, device = case.moe, _device()
    inp = make_inputs(case, rank, device)
    try:
        native = TorchNativeDispatcher(None, moe.num_experts)
        expert_x, _, state = native.dispatch(inp.x, inp.topk_idx, inp.topk_weights)
        y = per_token_cast_back(*expert_x).to(torch.bfloat16) if case.is_fp8 else expert_x
        out = native.combine(y, state)
    except Exception as exc:
        return f"raised {type(exc).__name__}: {exc}"
    x = per_token_cast_back(*inp.x).to(torch.bfloat16) if case.is_fp8 else inp.x
    w = torch.where(inp.topk_idx >= 0, inp.topk_weights, torch.zeros_like(inp.topk_weights))
    expected = (x.float().unsqueeze(1) * w.unsqueeze(2)).sum(dim=1).to(torch.bfloat16)
    if rank == 0 and fault == "torch-native":
        out = _corrupt(out)
    msg = first_mismatch("torch-native round trip", out, expected)
    return None if msg is None else f"rank {rank}: {msg}"


# ----------------------------------------------------------------------------------------------------------
# measurements
# ----------------------------------------------------------------------------------------------------------
def measure_epcomm(rank: int, world_size: int, cfg: EpcommConfig, iters: int, warmup: int) -> dict:
    """Times of epcomm's full dispatch, cached dispatch and (BF16 cases) combine on this rank.

    full: `dispatch(x, topk_idx, topk_weights, do_cpu_sync=True)` -- layout, count exchange, CPU sync, data,
    epilogue. cached: `dispatch(x, handle=...)` without weights (how DeepEP's tests time their kernels).
    combine: `combine(expert outputs, handle)` of random BF16 rows, unweighted, no weights carried back.
    """
    case, moe = cfg.case, cfg.case.moe
    device = _device()
    inp = make_inputs(case, rank, device)
    timer = Timer(dist.group.WORLD, device, iters, warmup)
    buf = _buffer(cfg)
    try:
        def full():
            return buf.dispatch(inp.x, inp.topk_idx, inp.topk_weights, num_experts=moe.num_experts,
                                do_cpu_sync=True, do_expand=cfg.do_expand, num_sms=cfg.num_sms)
        times = {("dispatch", "full"): timer.measure(full)}
        recv_x, _, _, handle, _ = full()
        times[("dispatch", "cached")] = timer.measure(
            lambda: buf.dispatch(inp.x, handle=handle, do_expand=cfg.do_expand, num_sms=cfg.num_sms))
        if not case.is_fp8:
            y = random_like_rows(case, rank, _rows(recv_x), moe.hidden, device, "expert-out")
            times[("combine", "full")] = timer.measure(lambda: buf.combine(y, handle, num_sms=cfg.num_sms))
        if device.type == "cuda":  # the same calls replayed from a CUDA graph: device time without host overhead
            times[("dispatch", "cached-graph")] = timer.measure_graph(
                lambda: buf.dispatch(inp.x, handle=handle, do_expand=cfg.do_expand, num_sms=cfg.num_sms))
            if not case.is_fp8:
                times[("combine", "graph")] = timer.measure_graph(lambda: buf.combine(y, handle, num_sms=cfg.num_sms))
    finally:
        buf.destroy()
    return dict(times=times, recv_rows=handle.num_recv_tokens, own_rows=_own_rows(handle, rank),
                sms=handle.num_sms if device.type == "cuda" else None)


GRAPH_CALLS = 8  # decode: calls captured back to back in one graph for the `graph-x8` mode


def measure_low_latency(rank: int, world_size: int, cfg: EpcommConfig, iters: int, warmup: int) -> dict:
    """Decode on GPU (docs/benchmarks.md, "Graph replay" and the dsv3-decode preset): CUDA-graph replays of
    `low_latency_dispatch` (BF16 in, FP8 cast inside) and `low_latency_combine` (BF16, weighted), and of the normal
    path without CPU sync (expand dispatch + combine), on the same inputs."""
    case, moe = cfg.case, cfg.case.moe
    device = _device()
    inp = make_inputs(case, rank, device)
    x = inp.x if not isinstance(inp.x, tuple) else per_token_cast_back(*inp.x).to(torch.bfloat16)
    timer = Timer(dist.group.WORLD, device, iters, warmup)
    n = case.tokens
    buf = EPBuffer(None, EPBuffer.get_low_latency_rdma_size_hint(n, moe.hidden, world_size, moe.num_experts),
                   num_max_tokens_per_rank=n, hidden=moe.hidden, num_topk=moe.num_topk, transport=cfg.transport,
                   explicitly_destroy=True, num_cpu_timeout_secs=BUFFER_TIMEOUT_S)
    try:
        recv_x, _, ll_handle, _, _ = buf.low_latency_dispatch(x, inp.topk_idx, n, moe.num_experts)
        y = random_like_rows(case, rank, recv_x[0].shape[0] * recv_x[0].shape[1], moe.hidden, device,
                             "expert-out").view(recv_x[0].shape)
        weights = inp.topk_weights.float()
        def ll_dispatch():
            return buf.low_latency_dispatch(x, inp.topk_idx, n, moe.num_experts)

        def ll_combine():
            return buf.low_latency_combine(y, inp.topk_idx, weights, ll_handle)
        times = {
            ("ll-dispatch", "graph"): timer.measure_graph(ll_dispatch),
            ("ll-combine", "graph"): timer.measure_graph(ll_combine),
            ("ll-dispatch", f"graph-x{GRAPH_CALLS}"): timer.measure_graph(ll_dispatch, calls=GRAPH_CALLS),
            ("ll-combine", f"graph-x{GRAPH_CALLS}"): timer.measure_graph(ll_combine, calls=GRAPH_CALLS),
        }
        _, _, _, handle, _ = buf.dispatch(inp.x, inp.topk_idx, num_experts=moe.num_experts, do_cpu_sync=False,
                                          do_expand=True)
        ys = random_like_rows(case, rank, handle.num_expanded_tokens, moe.hidden, device, "expert-out-2")
        times[("dispatch", "sync-free-graph")] = timer.measure_graph(
            lambda: buf.dispatch(inp.x, inp.topk_idx, num_experts=moe.num_experts, do_cpu_sync=False,
                                 do_expand=True))
        times[("combine", "sync-free-graph")] = timer.measure_graph(lambda: buf.combine(ys, handle))
    finally:
        buf.destroy()
    return dict(times=times, recv_rows=handle.num_recv_tokens, own_rows=_own_rows(handle, rank),
                sms=handle.num_sms)


def measure_torch_native(rank: int, world_size: int, case: Case, iters: int, warmup: int) -> dict:
    """Times of the torch-native dispatcher's dispatch and (BF16 cases) combine on this rank."""
    moe, device = case.moe, _device()
    inp = make_inputs(case, rank, device)
    timer = Timer(dist.group.WORLD, device, iters, warmup)
    native = TorchNativeDispatcher(None, moe.num_experts)
    times = {("dispatch", "full"): timer.measure(lambda: native.dispatch(inp.x, inp.topk_idx, inp.topk_weights))}
    expert_x, _, state = native.dispatch(inp.x, inp.topk_idx, inp.topk_weights)
    if not case.is_fp8:
        y = random_like_rows(case, rank, _rows(expert_x), moe.hidden, device, "native-expert-out")
        times[("combine", "full")] = timer.measure(lambda: native.combine(y, state))
    send = dedup_send_counts(inp.topk_idx, moe.num_experts, world_size)
    return dict(times=times, recv_rows=_recv_total(send, device), own_rows=send[rank], sms=None)


def _recv_total(send_counts: list, device: torch.device) -> int:
    """Rank-dedup rows this rank receives (one count exchange)."""
    send = torch.tensor(send_counts, dtype=torch.int64, device=device)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    return int(recv.sum())


def measure_raw_a2a(rank: int, world_size: int, case: Case, iters: int, warmup: int) -> dict:
    """Times of one `all_to_all_single` of the rank-dedup payload (`epcomm.baselines.raw_all_to_all`)."""
    moe, device = case.moe, _device()
    inp = make_inputs(case, rank, device)
    send = dedup_send_counts(inp.topk_idx, moe.num_experts, world_size)
    call = raw_all_to_all(send, moe.hidden, torch.float8_e4m3fn if case.is_fp8 else torch.bfloat16, device=device)
    timer = Timer(dist.group.WORLD, device, iters, warmup)
    times = {("a2a", "payload"): timer.measure(call)}
    return dict(times=times, recv_rows=call().shape[0], own_rows=send[rank], sms=None)


def measure_peer_copy(rank: int, world_size: int, iters: int, warmup: int) -> Optional[list]:
    """Rank 0: seconds of each 256 MiB `dst.copy_(src)` from cuda:0 to cuda:1 (copy engine). Others: None."""
    if rank != 0 or torch.cuda.device_count() < 2:
        return None
    src = torch.randint(0, 256, (PEER_COPY_BYTES,), dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(PEER_COPY_BYTES, dtype=torch.uint8, device="cuda:1")
    events = []
    for _ in range(warmup + iters):
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)  # runs on the source device's current stream
        end.record()
        events.append((start, end))
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize("cuda:1")
    if not torch.equal(dst[:4096].cpu(), src[:4096].cpu()):
        raise RuntimeError("peer copy ceiling: the copied bytes differ from the source")
    return [s.elapsed_time(e) * 1e-3 for s, e in events][warmup:]


def device_info(rank: int, world_size: int) -> dict:
    """The rank's device: name, SM count, driver, CUDA and NCCL versions (GPU), or "cpu"."""
    if _device().type != "cuda":
        return dict(device="cpu", num_cpus=os.cpu_count())
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    info = dict(device=props.name, num_sms=props.multi_processor_count, gpu_memory_bytes=props.total_memory,
                num_gpus=torch.cuda.device_count(), cuda=torch.version.cuda, num_cpus=os.cpu_count())
    try:
        info["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception:  # NCCL version unavailable on this build
        info["nccl"] = None
    info["driver"] = None
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            info["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else None
        except (OSError, subprocess.SubprocessError):
            pass
    return info
