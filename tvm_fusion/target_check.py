"""Bad-target checks of CUDA cross entropy calls that do not stall the GPU.

Every cross entropy kernel writes ``first_bad_row``: the first row whose target is
outside [0, V) and not ignore_index, or B when there is none (it reads a clamped
index, so a bad target is flagged, never read out of bounds). Reading that flag
right after the launch would wait for the kernel: a full host sync per call,
25-35% of the time on the largest inputs on the H200, and fatal to CUDA graphs.

So on CUDA the check is deferred. The launch enqueues a 4-byte copy of the flag
into a slot of pinned host memory, preset to -1, on the same stream; nothing
waits. Every later call, and :func:`check_targets`, looks at the finished slots
(a host memory read: the copy overwrote the -1) and raises
:class:`TargetOutOfRangeError` for the first call that had a bad row, naming the
row. ``check_targets()`` waits for all pending calls first: call it where the
program syncs anyway (logging the loss, the end of an epoch) to be sure that no
bad target went by. With ``check_targets=False`` a call copies nothing.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any

from .contracts import TargetOutOfRangeError

SLOTS = 1024  # calls in flight before the oldest must be waited for
UNWRITTEN = -1


@dataclass
class _Pending:
    slot: int
    batch: int
    classes: int
    ignore_index: int
    target: Any  # the call's target tensor, to name the bad value


class _Ring:
    """Pinned int32 slots, each a landing place for one call's flag."""

    def __init__(self, torch: Any):
        self.host = torch.full((SLOTS,), UNWRITTEN, dtype=torch.int32, pin_memory=True)
        self.values = self.host.numpy()  # the same pinned memory, read without torch
        self.views = [self.host[i : i + 1] for i in range(SLOTS)]
        self.busy = [False] * SLOTS  # a pending call owns the slot
        self.next = 0


_LOCK = threading.Lock()
_RING: _Ring | None = None
_PENDING: collections.deque[_Pending] = collections.deque()


def enqueue(flag: Any, batch: int, classes: int, ignore_index: int, target: Any) -> None:
    """Copy a CUDA call's ``first_bad_row`` flag to the host without waiting."""
    global _RING
    import torch

    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "cross_entropy: check_targets=True cannot run inside CUDA graph capture (the "
            "check reads a flag on the host after the kernel); pass check_targets=False"
        )
    with _LOCK:
        if _RING is None:
            _RING = _Ring(torch)
        ring = _RING
        slot = ring.next
        if ring.busy[slot]:  # SLOTS calls since this one: wait for it
            torch.cuda.synchronize()
            _raise_finished_locked()
        ring.next = (slot + 1) % SLOTS
        ring.busy[slot] = True
        ring.values[slot] = UNWRITTEN
        ring.views[slot].copy_(flag, non_blocking=True)
        _PENDING.append(_Pending(slot, batch, classes, ignore_index, target))


def raise_finished() -> None:
    """Raise for the first finished call that flagged a bad row; forget the good ones.

    Costs a few hundred nanoseconds when nothing is pending."""
    if _PENDING:
        with _LOCK:
            _raise_finished_locked()


def _raise_finished_locked() -> None:
    ring = _RING
    while _PENDING:
        pending = _PENDING[0]
        row = int(ring.values[pending.slot])
        if row == UNWRITTEN:
            return  # still running (later calls on this stream are too)
        _PENDING.popleft()
        ring.busy[pending.slot] = False
        if row < pending.batch:
            # One error at a time: the later calls are dropped, once their copies
            # have landed (so a reused slot never receives a stale flag).
            import torch

            torch.cuda.synchronize()
            for other in _PENDING:
                ring.busy[other.slot] = False
            _PENDING.clear()
            raise TargetOutOfRangeError(row, _value(pending.target, row), pending.classes, pending.ignore_index)


def check_targets() -> None:
    """Wait for every pending CUDA cross entropy call and raise
    :class:`TargetOutOfRangeError` for the first that had a bad target."""
    if not _PENDING:
        return
    import torch

    torch.cuda.synchronize()
    with _LOCK:
        _raise_finished_locked()


def pending() -> int:
    """Calls whose flag has not been looked at yet."""
    return len(_PENDING)


def _value(target: Any, row: int) -> int | None:
    try:
        return int(target[row].item())
    except Exception:  # noqa: BLE001 - the row alone still names the problem
        return None
