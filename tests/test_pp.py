"""`PPBuffer` (reference §16): FIFO per directed neighbour pair, randomised schedules within the in-flight limit,
bitwise payloads, clear errors, bounded waits."""

import os
import re
import subprocess
import sys
import time

import pytest
import torch

import collective_cases as cc
from epcomm.testing import run_in_fresh_world


@pytest.mark.parametrize("world,inflight,seed", [(2, 1, 0), (2, 3, 1), (3, 2, 2)])
def test_random_schedule_respecting_inflight(run_ranks, world, inflight, seed):
    sent = run_ranks(world, cc.pp_random_schedule, seed, inflight)
    assert sum(sent) > 20


def test_pp_on_a_subgroup(run_ranks):
    assert run_ranks(3, cc.pp_subgroup) == [None, 0, 1]


def test_pipeline_groups_of_ranks_seeded_alike(run_ranks):
    out = run_ranks(4, cc.pp_seeded_groups)
    assert [got for got, _ in out] == [[], [0.0, 1.0, 2.0], [], [200.0, 201.0, 202.0]], out
    uids = out[0][1]
    assert uids[0] == uids[1] and uids[2] == uids[3] and uids[0] != uids[2], uids


def test_schedule_generator_respects_limit():
    for seed in range(5):
        pending: dict = {}
        for action, s, d in cc.pp_schedule(seed, 3, 2, 200):
            pending[(s, d)] = pending.get((s, d), 0) + (1 if action == "send" else -1)
            assert 0 <= pending[(s, d)] <= 2
            assert d in ((s + 1) % 3, (s - 1) % 3)
        assert not any(pending.values())


PP_ERRORS = {
    "conjugate_view": ("ValueError", r"x is a lazily conjugated or negated view; call .resolve_conj\(\)"),
    "not_neighbour": ("ValueError", r"dst_rank_idx must be a ring neighbour of rank (\d): \(rank \+ 1\) % 2 or "
                                    r"\(rank - 1\) % 2, i.e. one of \[\d\]; got \1"),
    "too_large": ("ValueError", r"x has 68 bytes but num_max_tensor_bytes is 64"),
    "empty": ("ValueError", r"x is empty"),
    "non_contiguous": ("ValueError", r"x must be contiguous"),
    "not_tensor": ("TypeError", r"x must be a torch.Tensor, got list"),
    "bad_sizes": ("ValueError", r"num_max_tensor_bytes must be > 0, got 0"),
    "size_mismatch": ("ValueError", r"x has 16 bytes but send #0 from group rank \d carried 32; recv into a tensor "
                                    r"of the sent size"),
    "destroyed": ("ValueError", r"the PPBuffer was destroyed"),
    # recv's write is not recorded by autograd (was: a leaf requiring grad was overwritten silently)
    "requires_grad": ("ValueError", r"PPBuffer.recv: rank \d: x requires grad, and recv writes it in place where "
                                    r"autograd does not see it"),
    # a wrong type is a TypeError naming the argument (was: ValueError "must be a ring neighbour")
    "float_peer": ("TypeError", r"PPBuffer.send: rank \d: dst_rank_idx must be an int, got float [01]\.0$"),
    # timeouts are checked as EngramBuffer's and EPBuffer's (0 was accepted, then every wait timed out at once)
    "timeout_zero": ("ValueError", r"PPBuffer: rank \d: num_cpu_timeout_secs must be > 0 seconds, got 0"),
    "timeout_type": ("TypeError", r"PPBuffer: rank \d: num_gpu_timeout_secs must be a number of seconds, got str"),
}


def test_pp_errors(run_ranks):
    for rank, out in enumerate(run_ranks(2, cc.pp_errors)):
        assert out["after_mismatch"] == [7.0, 7.0, 7.0], "the FIFO stays in step after a size mismatch"
        assert out["no_grad_leaf"] == [5.0, 5.0], out["no_grad_leaf"]
        for name, (cls, pattern) in PP_ERRORS.items():
            assert out[name] is not None and out[name][0] == cls, (name, out[name])
            with pytest.raises({"ValueError": ValueError, "TypeError": TypeError}[cls], match=pattern):
                raise {"ValueError": ValueError, "TypeError": TypeError}[cls](out[name][1])
            assert f"rank {rank}" in out[name][1]


GROUP_TYPE_ERROR = r"group must be a torch.distributed ProcessGroup this rank belongs to, or None for the default group"


def check_bad_groups(outs: list, owner: str) -> None:
    """`cc.bad_groups`: a TypeError naming the argument (was: AttributeError "'str' object has no attribute 'rank'")."""
    for rank, out in enumerate(outs):
        cls, msg = out["string"]
        assert cls == "TypeError" and re.search(rf"{owner}: rank {rank}: {GROUP_TYPE_ERROR}; got str 'x'$", msg), msg
    cls, msg = outs[0]["outside"]
    assert cls == "TypeError" and re.search(
        rf"{owner}: rank 0: {GROUP_TYPE_ERROR}; got int -100 \(what dist.new_group returns on a rank outside the new "
        r"group: only the group's members construct the buffer\)", msg), msg


def test_group_that_is_not_a_process_group(run_ranks):
    outs = run_ranks(2, cc.bad_groups, "pp")
    check_bad_groups(outs, "PPBuffer")
    assert outs[1]["outside"][0] == "ValueError" and "a pipeline ring needs >= 2" in outs[1]["outside"][1], outs[1]


def _send_then_drop(rank, world):
    """Rank 0 sends twice and drops its buffer (no destroy); rank 1 receives a moment later; then ten rounds of
    make, send, recv, drop."""
    import gc
    import time

    import epcomm.pp
    from epcomm import PPBuffer

    pp = PPBuffer(None, 64, 2, num_cpu_timeout_secs=30)
    got = []
    if rank == 0:
        pp.send(torch.full((4,), 5.0), 1)
        pp.send(torch.arange(4.0), 1)
        del pp
        gc.collect()
    else:
        time.sleep(0.5)
        got = [pp.recv(torch.empty(4), 0).tolist() for _ in range(2)]
    torch.distributed.barrier()
    for i in range(10):
        pp = PPBuffer(None, 64, 1, num_cpu_timeout_secs=30)
        pp.send(torch.full((1,), float(i)), (rank + 1) % world)
        got.append(pp.recv(torch.empty(1), (rank - 1) % world).item())
        del pp
        gc.collect()
    torch.distributed.barrier()
    deadline = time.monotonic() + 20
    while epcomm.pp._DRAINING and time.monotonic() < deadline:
        time.sleep(0.01)
    return got, len(epcomm.pp._DRAINING)


def test_sends_of_a_dropped_buffer_still_arrive(run_ranks):
    """Garbage collection never communicates, and a send copies its tensor at once: a buffer dropped without
    destroy() keeps its channels until its sends are received (it used to close them under the message)."""
    sender, receiver = run_ranks(2, _send_then_drop)
    assert receiver[0] == [[5.0] * 4, [0.0, 1.0, 2.0, 3.0]] + [float(i) for i in range(10)], receiver
    assert sender[0] == [float(i) for i in range(10)], sender
    # Once received, the dropped buffers' channels are let go (threads and sockets do not pile up).
    assert sender[1] == receiver[1] == 0, (sender[1], receiver[1])


def _destroy_with_unreceived_sends(rank, world):
    """Rank 0 sends three messages to rank 1, which receives one, then every rank destroys; then rank 1 receives
    the rest and every rank destroys again. Returns (error class, message, seconds) of the first destroy and the
    messages received after it."""
    import time

    from epcomm import PPBuffer

    pp = PPBuffer(None, 64, 4, num_cpu_timeout_secs=60)
    if rank == 0:
        for i in range(3):
            pp.send(torch.full((2,), float(i)), 1)
    got = [pp.recv(torch.empty(2), 0).tolist()] if rank == 1 else []
    start = time.monotonic()
    try:
        pp.destroy()
        first = (None, None, time.monotonic() - start)
    except ValueError as e:
        first = ("ValueError", str(e), time.monotonic() - start)
    if rank == 1:
        got += [pp.recv(torch.empty(2), 0).tolist() for _ in range(2)]
    pp.destroy()
    return first, got


@pytest.mark.parametrize("world", [2, 3])
def test_destroy_with_an_unreceived_send_raises_on_every_rank(run_ranks, world):
    """An unreceived send made destroy() wait for the timeout on the sender; now every rank raises at once, with the
    same message, and the buffer stays usable for the missing receives and a second destroy."""
    results = run_ranks(world, _destroy_with_unreceived_sends)
    for rank, ((cls, msg, seconds), got) in enumerate(results):
        assert cls == "ValueError", (rank, cls, msg)
        assert re.search(rf"PPBuffer.destroy: rank {rank}: group rank 0 sent 3 messages to group rank 1, which "
                         r"received 1 \(sends #1..#2 are unreceived\); receive every message before destroy\(\)",
                         msg), msg
        assert seconds < 10, seconds
    assert results[1][1] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]], results[1][1]


def test_waits_are_bounded_and_name_the_peer():
    """Rank 0: a send with no free slot, then a barrier rank 1 skips; rank 1: a recv nothing feeds."""
    timeout_s = 2.0
    results = run_in_fresh_world(2, cc.timeouts, timeout_s, timeout=60)
    (cls0, msg0), elapsed0, (barrier, after) = results[0]
    assert cls0 == "TransportTimeout" and re.search(
        r"PPBuffer.send: rank 0: send #1 to group rank 1 waited 2 s .* group rank 1 has not received send #0 "
        r"\(num_max_inflight_tensors=1", msg0), msg0
    assert elapsed0 < timeout_s + 3
    assert barrier[0] == "TransportTimeout" and re.search(r"BucketBuffer.barrier: rank 0 waited 2 s .* group ranks "
                                                          r"\[1\] did not arrive", barrier[1]), barrier
    assert after[0] == "ValueError" and "unusable after an earlier failure" in after[1]
    (cls1, msg1), elapsed1, _ = results[1]
    assert elapsed1 < timeout_s + 3
    assert cls1 == "TransportTimeout" and re.search(r"PPBuffer.recv: rank 1: waited 2 s .* for send #0 from group "
                                                    r"rank 0", msg1), msg1
    assert issubclass(__import__("epcomm.transport.base", fromlist=["x"]).TransportTimeout, TimeoutError)


def test_a_closed_channel_gives_peer_failed():
    (cls0, msg0), (cls1, msg1) = run_in_fresh_world(2, cc.pp_send_after_the_neighbour_gave_up, 2.0, timeout=60)
    assert cls0 == "TransportTimeout" and "PPBuffer.recv: rank 0: waited 2 s" in msg0, msg0
    assert cls1 == "PeerFailed" and msg1.startswith("PPBuffer.send: rank 1: the channel to the neighbour (group rank "
                                                    "0) closed"), msg1


# One rank of a fresh 2-rank world (`python -c _EXIT_SCRIPT RANK INIT_METHOD CASE TIMEOUT`): a PPBuffer whose send
# to the neighbour is never received (or is received late), then the script ends. Prints "END <time.time()>" when
# the script is done, so that the test can time the interpreter's exit.
_EXIT_SCRIPT = r"""
import sys, time
import torch, torch.distributed as dist
rank, init, case, timeout_s = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
from epcomm import PPBuffer
pp = PPBuffer(None, 64, 2, num_cpu_timeout_secs=timeout_s)
if case != "receive_late" or rank == 0:
    pp.send(torch.full((2,), 7.0), 1 - rank)
dist.barrier()
if case == "destroy_raised":
    try:
        pp.destroy()
    except ValueError as e:
        print("RAISED", "unreceived" in str(e), flush=True)
elif case == "del":
    del pp
elif case == "receive_late":  # rank 0 drops the buffer and ends; rank 1 receives after rank 0's script ended
    if rank == 0:
        del pp
    else:
        time.sleep(1.5)
        print("GOT", pp.recv(torch.empty(2), 0).tolist(), flush=True)
elif case == "peer_stays" and rank == 1:  # rank 1 neither receives nor ends for a while
    time.sleep(timeout_s + 2.5)
print("END", time.time(), flush=True)
"""


def _exit_times(tmp_path, case: str, timeout_s: float, limit_s: float) -> list:
    """Run _EXIT_SCRIPT on 2 ranks; return per rank (return code, seconds from END to exit, stdout, stderr)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    init = f"file://{tmp_path / 'store'}"
    procs = [subprocess.Popen([sys.executable, "-c", _EXIT_SCRIPT, str(r), init, case, str(timeout_s)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    deadline, exited = time.monotonic() + limit_s, [None, None]
    while time.monotonic() < deadline and None in exited:
        for r, p in enumerate(procs):
            if exited[r] is None and p.poll() is not None:
                exited[r] = time.time()
        time.sleep(0.02)
    out = []
    for r, p in enumerate(procs):
        if p.poll() is None:
            p.kill()
        stdout, stderr = p.communicate()
        end = [float(line.split()[1]) for line in stdout.splitlines() if line.startswith("END ")]
        took = exited[r] - end[0] if exited[r] is not None and end else None
        out.append((p.returncode, took, stdout, stderr[-3000:]))
    return out


@pytest.mark.parametrize("case", ["keep", "del", "destroy_raised", "receive_late", "peer_stays"])
def test_exit_with_an_unreceived_send_is_bounded(tmp_path, case):
    """A send nobody receives used to keep the process from exiting: the buffer's finalizer ran at interpreter
    shutdown and started a drain thread that could never run, so Thread.start() waited for ever (with `del`, the
    drain thread was still inside a gloo wait at exit and CPython's forced unwind of it aborted the process). Now
    exit closes the receiving channels, waits at most num_cpu_timeout_secs for this rank's sends and never aborts;
    a dropped buffer's send is still delivered to a neighbour that receives after the sender's script ended."""
    timeout_s = 3.0
    results = _exit_times(tmp_path, case, timeout_s, limit_s=14)
    for rank, (rc, took, stdout, stderr) in enumerate(results):
        assert rc == 0 and took is not None, (case, rank, rc, stdout, stderr)
        if case == "peer_stays" and rank == 0:  # rank 1 neither receives nor closes: the timeout bounds the exit
            assert 0.5 * timeout_s < took < timeout_s + 2.5, (took, stderr)
        elif case == "receive_late" and rank == 0:  # rank 0's exit waits for rank 1's receive (1.5 s), not longer
            assert took < timeout_s, (took, stderr)
        else:  # both ends exit: each closes its receiving side, so the other's send fails at once
            assert took < 2.5, (case, rank, took, stderr)
    if case == "destroy_raised":
        assert all("RAISED True" in out[2] for out in results), results
    if case == "receive_late":
        assert "GOT [7.0, 7.0]" in results[1][2], results[1]


@pytest.mark.parametrize("inflight,seed", [(1, 0), (3, 1)])
@pytest.mark.multigpu
@pytest.mark.skipif(__import__("torch").cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_random_schedule_on_gpu(pools, inflight, seed):
    pools.get(2, "nccl").run(cc.pp_random_schedule, seed, inflight, 200, 1 << 20, device="cuda")
