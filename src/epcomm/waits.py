"""Bounded host waits for collectives: every wait ends within `num_cpu_timeout_secs` and names missing ranks.

A rank that has waited longer than a short grace announces itself in the process group's store under a key of
(buffer id, call number, rank); on expiry the waiting rank compares the announced ranks with the group and names
those missing. Used by the transports (EPBuffer) and by the collective buffers of `comm.py`.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist


class TransportTimeout(TimeoutError):
    """A peer did not arrive within `num_cpu_timeout_secs`; the buffer is unusable afterwards."""


def default_store() -> Optional["dist.Store"]:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # not every init method exposes a store; then missing ranks cannot be named
        return None


def _key(uid: int, call_id: int, rank: int) -> str:
    return f"epcomm/{uid}/{call_id}/{rank}"


def _gave_up_key(uid: int, call_id: int, rank: int) -> str:
    return f"epcomm/{uid}/{call_id}/{rank}/gave-up"


def _gave_up_by_key(uid: int) -> str:
    return f"epcomm/{uid}/gave-up"  # "rank\ncall id" of the first rank whose wait in this buffer timed out


def _failed_key(uid: int) -> str:
    return f"epcomm/{uid}/failed"


def _group_failed_key(group) -> Optional[str]:
    """The store key of a failure on `group`, shared by every buffer on it (its ranks agree on its name)."""
    name = getattr(group, "group_name", None) if group is not None else None
    return f"epcomm/group/{name}/failed" if name else None


def announce(uid: int, call_id: int, rank: int) -> None:
    store = default_store()
    if store is not None:
        store.set(_key(uid, call_id, rank), "1")


def announce_failure(uid: int, call_id: int, rank: int, call: str, error: str, group=None, unit: str = "call") -> None:
    """Tell the peers that `rank` stopped with `error` during `call` (`unit` number `call_id`) of buffer `uid` (out of
    memory, ...: not a bad argument, which every rank reports together): their bounded waits in this or any later
    call of the buffer (GPU calls without a host wait come before one) raise `PeerFailed` naming it rather than
    wait out the timeout for a rank that will not come. The first failure recorded stays (a later one is likely
    its consequence, such as a peer's connection closed by the failing rank's exit). With `group` the failure is
    also recorded for every buffer on the group: a peer that completed this call and goes on with another buffer
    of the group learns it there."""
    store = default_store()
    if store is not None:
        # "collective #n" numbers the waits, so a failure between two is "after" the last one this rank made
        number = f"call #{call_id}" if unit == "call" else f"after {unit} #{call_id}"
        record = f"{rank}\n{number}\n{call}\n{error[:500]}"
        try:
            for key in (_failed_key(uid), _group_failed_key(group)):
                if key is not None and not store.check([key]):
                    store.set(key, record)
        except Exception:  # a store that is gone: the peers time out as before
            pass


def fail_mid_call(e: BaseException, *, uid: int, call_id: int, rank: int, call: str, owner: str, group,
                  mark_broken, unit: str = "call") -> None:
    """An error of this rank's own (out of memory, ...) after the ranks agreed on `call`: its peers are in, or will
    enter, collectives this rank does not join, so the buffer and its process group cannot be used again
    (`mark_broken(reason)`, which calls `break_group`). The failure goes into the store for the peers' bounded waits
    (`PeerFailed` naming this rank). Re-raises `e`; or, when a peer had already failed (this error is then likely
    its consequence: a connection its exit closed), raises `PeerFailed` naming that peer."""
    earlier = peer_failure(uid, group)
    if earlier is not None and earlier[0] != rank:
        mark_broken(f"{call}: group rank {earlier[0]} failed during the call")
        raise PeerFailed(peer_failed_message(call, call_id, rank, earlier, owner, group, unit)) from e
    if communication_error(e):  # a peer went away without a record (killed, exited): not this rank's own error
        mark_broken(f"{call}: the process group failed during the call ({type(e).__name__})")
        raise PeerFailed(lost_peer_message(call, rank, unit, call_id, e, owner)) from e
    mark_broken(f"{call} failed on this rank during the call ({type(e).__name__})")
    announce_failure(uid, call_id, rank, call, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__, group,
                     unit)
    raise e


_CONNECTION_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "gloo/transport",
                    "NCCL error", "NCCL communicator was aborted")


def communication_error(e: BaseException) -> bool:
    """Whether `e` is the process group's own failure (a peer's connection lost, a communicator aborted), which a
    rank meets when a peer died, rather than an error of its own."""
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(e, dist_error):
        return True
    return isinstance(e, RuntimeError) and any(s in str(e) for s in _CONNECTION_LOST)


def peer_failure(uid: int, group=None) -> Optional[tuple]:
    """`(rank, "call #n" or "collective #n", call, error)` of the failure recorded for buffer `uid`, or else for any
    buffer on `group`; or None."""
    store = default_store()
    try:
        for key in (_failed_key(uid), _group_failed_key(group)):
            if store is not None and key is not None and store.check([key]):
                rank, call_id, call, error = store.get(key).decode(errors="replace").split("\n", 3)
                return int(rank), call_id, call, error
        return None
    except Exception:  # the store itself failed (or an odd record): as if nothing were recorded
        return None


def peer_failed_message(what: str, call_id, rank: int, failure: tuple, owner: str, group=None,
                        unit: str = "call") -> str:
    """The message of `PeerFailed`: who waited for what, which rank failed in which call, with which error. `unit`:
    what this rank's numbers count ("call": an EPBuffer's calls; "collective": a `comm.CommContext`'s host waits,
    several per bucket or Engram call); the failed rank's record carries its own."""
    failed, failed_number, failed_call, error = failure
    every = global_ranks(group)
    who, me = f"group {rank_name(failed, every)}", rank_name(rank, every)
    return (f"{what}: {me} waited for {unit} #{call_id} but {who} stopped with an error during its {failed_call} "
            f"({failed_number}): {error.rstrip().rstrip('.')}. The call cannot complete: the {owner} and its process "
            "group are unusable now (an unmatched collective is pending): end the job; while that rank is alive the "
            "process cannot exit cleanly, so exit with os._exit(1) or let the launcher kill it")


_BROKEN_GROUPS: dict = {}  # id(process group) -> (the group, why): groups holding a collective that cannot complete


def break_group(group, reason: str) -> None:
    """Record that `group` holds a collective that will not complete (an epcomm call on it timed out or failed
    mid-call on this rank): every epcomm buffer on it in this process refuses later calls and constructions, since
    a new collective on it would meet the pending one (gloo aborts the process on such a mismatch)."""
    if group is not None:
        _BROKEN_GROUPS[id(group)] = (group, reason)


def group_broken(group) -> Optional[str]:
    """Why `group` is unusable in this process (`break_group`), or None."""
    entry = _BROKEN_GROUPS.get(id(group))
    return entry[1] if entry is not None and entry[0] is group else None


def require_group_usable(group, where: str) -> None:
    """Raise ValueError, prefixed `where` (the call and the rank), when `break_group` recorded `group`."""
    why = group_broken(group)
    if why is not None:
        raise ValueError(f"{where}: the process group is unusable after an earlier failure of an epcomm buffer on it "
                         f"({why}); restart the process group")


class PeerFailed(TransportTimeout):
    """A peer stopped during the call. With an error of its own (out of memory, an interrupt, a bug) after the ranks
    agreed on it: raised by this rank's bounded wait within about a second of the peer's record in the process
    group's store, naming the peer (group and global rank), its call and its error. Without a record (its process
    exited or was killed, and the process group's connection to it failed): raised at once, with the backend's own
    error as its cause (the backend does not say which rank). The buffer, and every epcomm buffer on its process
    group in this process, are unusable afterwards (docs/decisions.md "Errors and timeouts"). A `TimeoutError`
    (and `TransportTimeout`), so code that catches timeouts catches it."""


def backend_said(e: BaseException) -> str:
    """The first line of a backend error's message (gloo's run over several lines), for epcomm's own messages."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def lost_peer_message(what: str, rank: int, unit: str, call_id: int, e: BaseException, owner: str) -> str:
    """The message of `PeerFailed` for a communication error of the group itself (`communication_error`)."""
    said = backend_said(e)
    return (f"{what}: rank {rank}: the process group's connection to a peer failed during {unit} #{call_id} and no "
            f"peer recorded an error of its own: a peer process exited or was killed (the backend said: {said}). The "
            f"{owner} and its process group are unusable now: end the job (exit with os._exit(1) or let the launcher "
            "kill it)")


def bounded_wait(work: "dist.Work", *, what: str, call_id: int, rank: int, num_ranks: int, uid: int,
                 device: torch.device, timeout_s: float, owner: str = "buffer",
                 group: Optional["dist.ProcessGroup"] = None, unit: str = "call") -> None:
    """Wait on the host for `work`, at most `timeout_s` seconds. `call_id` numbers the wait among the buffer's (the
    same on every rank), as a `unit` in messages (see `peer_failed_message`).

    Raises:
        TransportTimeout: a peer did not arrive; names the missing group ranks (and, on a subgroup `group`, their
            global ranks) and says how to end the job. `PeerFailed`: a peer recorded an error of its own, or the
            group's connection to a peer failed (its process is gone).
    """
    try:
        _bounded_wait(work, what, call_id, rank, num_ranks, uid, device, timeout_s, owner, group, unit)
    except RuntimeError as e:  # the backend's own error: a peer's process is gone (gloo: its connection closed)
        if not communication_error(e):
            raise
        raise PeerFailed(lost_peer_message(what, rank, unit, call_id, e, owner)) from e


def _bounded_wait(work, what, call_id, rank, num_ranks, uid, device, timeout_s, owner, group, unit) -> None:
    start = time.monotonic()
    settle = min(1.0, timeout_s / 4)  # the last part of the wait, in which peers that wait too announce themselves
    announced = False
    next_look = start + settle  # slow waits look in the store for a failed or departed peer, twice a second
    while not work.is_completed():
        now = time.monotonic()
        if not announced and now > start + settle:
            announce(uid, call_id, rank)  # only slow waits pay for a store round trip
            announced = True
        if now > next_look:
            next_look = now + 0.5
            _raise_if_peer_failed(what, call_id, rank, uid, owner, group, unit)
            _raise_if_peer_gave_up(what, call_id, rank, uid, owner, group, unit, now - start)
        if now > start + timeout_s - settle:
            _raise_timeout(what, call_id, rank, num_ranks, uid, timeout_s, owner, group, unit, work)
        # NOTE: on GPU spin first: a sleeping poll added ~3 ms to every CPU-synced NCCL dispatch (2x H200,
        # dsv3, 4.3 ms full vs 1.1 ms cached). On CPU the peers' gloo threads need the cores: always sleep.
        if device.type == "cpu" or now - start > 2e-3:
            time.sleep(1e-4)
    work.wait()


def _raise_if_peer_gave_up(what: str, call_id: int, rank: int, uid: int, owner: str, group, unit: str,
                           waited: float) -> None:
    """A late rank: a peer's wait in this buffer already timed out, so the buffer's collectives cannot complete
    (the late rank's own exchange may even have paired with the one its peer abandoned and gone on to the next):
    raise now, naming it, rather than wait out this rank's timeout. Not for uid 0 (constructions, whose buffer has
    no id yet: their keys are shared by every construction in the job)."""
    store = default_store()
    try:
        if store is None or not uid or not store.check([_gave_up_by_key(uid)]):
            return
        gone, gone_call = store.get(_gave_up_by_key(uid)).decode().split("\n")
    except Exception:  # the store itself failed, or an odd record: wait on
        return
    if int(gone) == rank:
        return
    every = global_ranks(group)
    raise TransportTimeout(
        f"{what}: {rank_name(rank, every)} waited {waited:.1f} s for {unit} #{call_id} but group "
        f"{rank_name(int(gone), every)} gave up waiting in {unit} #{gone_call} of this {owner} (its own timeout) "
        f"before this rank came. Every rank of the group must make the same {owner} calls in the same order. The "
        f"{owner} and its process group are unusable now (an unmatched collective is pending): end the job; exit "
        "with os._exit(1) or let the launcher kill it")


def _raise_if_peer_failed(what: str, call_id: int, rank: int, uid: int, owner: str, group, unit: str) -> None:
    """Raise `PeerFailed` when a peer recorded that it stopped with an error during a call of this buffer."""
    failure = peer_failure(uid, group)
    if failure is not None and failure[0] != rank:
        raise PeerFailed(peer_failed_message(what, call_id, rank, failure, owner, group, unit))


def rank_name(rank: int, every: Optional[list]) -> str:
    """"rank r", with its global rank on a subgroup (`every`: `global_ranks`)."""
    return f"rank {rank}" + (f" (global rank {every[rank]})" if every else "")


def ranks_name(ranks: list, every: Optional[list]) -> str:
    """"group ranks [..]", with their global ranks on a subgroup (`every`: `global_ranks`)."""
    return f"group ranks {ranks}" + (f" (global ranks {[every[r] for r in ranks]})" if every else "")


def global_ranks(group) -> Optional[list]:
    """The global rank of every group rank when `group` is a subgroup (the processes a user looks for), else None."""
    try:
        every = dist.get_process_group_ranks(group) if group is not None else None
    except Exception:  # a group torch no longer knows: the group ranks alone
        return None
    return every if every and every != list(range(len(every))) else None


def _raise_timeout(what: str, call_id: int, rank: int, num_ranks: int, uid: int, timeout_s: float,
                   owner: str, group=None, unit: str = "call", work=None) -> None:
    """Raise the timeout of a wait for `work`, after a last moment for waiting peers to announce themselves (the
    wait's final `min(1 s, timeout / 4)`); returns instead if `work` completed meanwhile."""
    store = default_store()
    every = global_ranks(group)

    missing: Optional[list] = None
    gave_up: list = []
    if store is not None:
        announce(uid, call_id, rank)
        settle_end = time.monotonic() + min(1.0, timeout_s / 4)  # peers that wait too announce themselves
        while time.monotonic() < settle_end:
            if work is not None and work.is_completed():  # a peer came in the last moment: no timeout
                return
            time.sleep(1e-3)
        missing = [r for r in range(num_ranks) if r != rank and not store.check([_key(uid, call_id, r)])]
        gave_up = [r for r in range(num_ranks) if r != rank and store.check([_gave_up_key(uid, call_id, r)])]
        # A peer that comes later finds this rank announced but gone: say so rather than "every rank arrived".
        store.set(_gave_up_key(uid, call_id, rank), "1")
        if uid:
            store.compare_set(_gave_up_by_key(uid), "", f"{rank}\n{call_id}")  # the first rank to give up
    if missing:
        who = f"{ranks_name(missing, every)} did not arrive"
    elif gave_up:
        who = (f"{ranks_name(gave_up, every)} gave up waiting for this call (their own timeout) before this rank "
               "came or before it finished")
    elif missing is None:
        who = "a peer (could not tell which) did not arrive"
    else:
        who = ("every group rank arrived and the collective still did not finish (a peer that died after it "
               "arrived, or calls or sizes that do not match between the ranks)")
    me = rank_name(rank, every)
    raise TransportTimeout(
        f"{what}: {me} waited {timeout_s:g} s (num_cpu_timeout_secs) for {unit} #{call_id} but {who}. Every "
        f"rank of the group must make the same {owner} calls in the same order. The {owner} and its process group "
        "are unusable now (an unmatched collective is pending): end the job; while the missing rank is alive the "
        "process cannot exit cleanly, so exit with os._exit(1) or let the launcher kill it")
