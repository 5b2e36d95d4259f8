"""Bad-target checks of CUDA cross entropy calls that do not stall the GPU.

Every cross entropy kernel writes ``first_bad_row``: the first row whose target is
outside [0, V) and not ignore_index, or B when there is none (it reads a clamped
index, so a bad target is flagged, never read out of bounds). Reading that flag
right after the launch would wait for the kernel: a full host sync per call,
25-35% of the time on the largest inputs on the H200, and fatal to CUDA graphs.

So on CUDA the check is deferred, and costs neither a copy nor an allocation. The
flag parameter of the kernel is a slot of pinned host memory, preset to -1: with
CUDA's unified addressing a kernel can store to pinned host memory through the
host's own pointer, so the kernel writes its flag straight to the host and
nothing waits. Every later call, and :func:`check_targets`, looks at the written
slots (a host memory read) and raises :class:`TargetOutOfRangeError` for the first
call that had a bad row, naming the row. ``check_targets()`` waits for all
pending calls first: call it where the program syncs anyway (logging the loss,
the end of an epoch) to be sure that no bad target went by.

With ``check_targets=False`` the kernels write their flag to one more slot that
nobody reads (the sink), so such a call allocates nothing for it either, and can
be captured in a CUDA graph.
"""

from __future__ import annotations

import collections
import ctypes
import threading
from typing import Any

import tvm_ffi

from .contracts import TargetOutOfRangeError

SLOTS = 1024  # calls in flight before the oldest must be waited for
UNWRITTEN = -1
STRIDE = 4  # int32s between slots: every slot is 16-byte aligned, as kernel parameters are
_KDL_CUDA = 2


# A pending call: (slot, batch, classes, ignore_index, target), the target tensor to
# name the bad value (a tuple: a launch makes one, and a dataclass costs more).
_Pending = tuple


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_KEEP_ALIVE: list[Any] = []  # the DLPack structs that device views point at
# PyCapsule_New with its own prototype (ctypes.pythonapi's is shared with other libraries)
_NEW_CAPSULE = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))


def int32_view(address: int, device_type: int, device_id: int) -> tvm_ffi.Tensor:
    """A (1,) int32 TVM tensor at ``address`` on the given DLPack device.

    The ring makes CUDA views of pinned host memory this way (torch has no tensor
    of another device's memory); the address must stay valid for as long as the
    view lives, and the view owns nothing."""
    shape = (ctypes.c_int64 * 1)(1)
    managed = _DLManagedTensor()
    managed.dl_tensor = _DLTensor(
        ctypes.c_void_p(address), _DLDevice(device_type, device_id), 1, _DLDataType(0, 32, 1),
        ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64)), None, 0,
    )
    _KEEP_ALIVE.append((shape, managed))
    return tvm_ffi.from_dlpack(_NEW_CAPSULE(ctypes.addressof(managed), b"dltensor", None))


class _Ring:
    """Pinned int32 slots, each the flag parameter of one call's kernel."""

    def __init__(self, torch: Any):
        self.host = torch.full(((SLOTS + 1) * STRIDE,), UNWRITTEN, dtype=torch.int32, pin_memory=True)
        self.values = memoryview(self.host.numpy())  # the same pinned memory as Python ints
        self.busy = [False] * SLOTS  # a pending call owns the slot
        self.next = 0
        self._views: dict[int, list[tvm_ffi.Tensor]] = {}

    def views(self, device_id: int) -> list[tvm_ffi.Tensor]:
        """Every slot (the sink last) as a CUDA tensor of device ``device_id``."""
        if device_id not in self._views:
            base = self.host.data_ptr()
            self._views[device_id] = [
                int32_view(base + 4 * STRIDE * slot, _KDL_CUDA, device_id) for slot in range(SLOTS + 1)
            ]
        return self._views[device_id]

    def value(self, slot: int) -> int:
        return self.values[slot * STRIDE]


_LOCK = threading.Lock()
_RING: _Ring | None = None
_CAPTURING: Any = None  # torch's is-the-current-stream-capturing test, looked up once
_PENDING: collections.deque[_Pending] = collections.deque()


def _ring() -> _Ring:
    global _RING
    if _RING is None:
        import torch

        with _LOCK:
            if _RING is None:
                _RING = _Ring(torch)
    return _RING


def sink(device_id: int) -> tvm_ffi.Tensor:
    """The flag parameter for a call that checks nothing: written, never read."""
    return _ring().views(device_id)[SLOTS]


def launch_checked(func: Any, args: list[Any], flag_at: int, device_id: int, batch: int, classes: int,
                   ignore_index: int, target: Any) -> None:
    """``func(*args)`` with a claimed slot as ``args[flag_at]``: an earlier call's bad
    target is raised first (if its kernel has run), the slot is reset to -1 and
    recorded as pending, and a failed launch gives it back."""
    global _CAPTURING
    if _CAPTURING is None:
        import torch

        _CAPTURING = torch._C._cuda_isCurrentStreamCapturing
    if _CAPTURING():
        raise RuntimeError(
            "cross_entropy: check_targets=True cannot run inside CUDA graph capture (the "
            "check reads a flag on the host after the kernel); pass check_targets=False"
        )
    ring = _RING or _ring()
    with _LOCK:
        if _PENDING:
            _raise_finished_locked()
        slot = ring.next
        if ring.busy[slot]:  # SLOTS calls since this one: wait for it
            import torch

            torch.cuda.synchronize()
            _raise_finished_locked()
        ring.next = (slot + 1) % SLOTS
        ring.busy[slot] = True
        ring.values[slot * STRIDE] = UNWRITTEN
        _PENDING.append((slot, batch, classes, ignore_index, target))
    args[flag_at] = ring.views(device_id)[slot]
    try:
        func(*args)
    except BaseException:
        unclaim(slot)
        raise


def unclaim(slot: int) -> None:
    """Forget a claimed slot whose launch raised."""
    with _LOCK:
        for pending in _PENDING:
            if pending[0] == slot:
                _PENDING.remove(pending)
                _RING.busy[slot] = False
                return


def _raise_finished_locked() -> None:
    ring = _RING
    while _PENDING:
        slot, batch, classes, ignore_index, target = _PENDING[0]
        row = ring.value(slot)
        if row == UNWRITTEN:
            return  # still running (later calls on this stream are too)
        _PENDING.popleft()
        ring.busy[slot] = False
        if row < batch:
            # One error at a time: the later calls are dropped, once their kernels
            # have finished (so a reused slot never receives a stale flag).
            import torch

            torch.cuda.synchronize()
            for other in _PENDING:
                ring.busy[other[0]] = False
            _PENDING.clear()
            raise TargetOutOfRangeError(row, _value(target, row), classes, ignore_index)


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
