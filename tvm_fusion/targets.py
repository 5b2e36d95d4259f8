"""Target names and dicts: what ``target=`` accepts and how it becomes a TVM Target."""

from __future__ import annotations

import functools
from typing import Any

import tvm
from tvm.target import Target

KINDS = ("cuda", "llvm")
DEFAULT_CUDA_ARCH = "sm_90"  # the H200 the anchor figures come from


@functools.cache
def _host_cpu() -> Target:
    return Target.from_device("cpu")


@functools.cache
def _gpu0() -> tuple[str, int, int] | None:
    """GPU 0's (arch, SMs, L2 bytes), asked once per process; None without one."""
    try:
        dev = tvm.cuda(0)
        if dev.exist:
            major, minor = dev.compute_version.split(".")
            return f"sm_{major}{minor}", int(dev.multi_processor_count or 0), int(dev.l2_cache_size_bytes or 0)
    except Exception:  # noqa: BLE001 - no CUDA runtime here: generate for the default
        pass
    return None


def _cuda_arch() -> str:
    """The arch of GPU 0 when one is there, else the H200's (code generation only)."""
    gpu = _gpu0()
    return gpu[0] if gpu else DEFAULT_CUDA_ARCH


def resolve(target: Any) -> Target:
    """``"cuda"`` / ``"llvm"`` / a TVM 0.27 target dict / a Target -> Target."""
    if isinstance(target, Target):
        return target
    if isinstance(target, str):
        if target == "cuda":
            return Target({"kind": "cuda", "arch": _cuda_arch()})
        if target in ("llvm", "cpu"):
            return _host_cpu()
        raise ValueError(
            f"target must be 'cuda', 'llvm' or a target dict like "
            f"{{'kind': 'cuda', 'arch': 'sm_90'}}, got {target!r}"
        )
    if isinstance(target, dict):
        kind = target.get("kind")
        if kind not in KINDS:
            raise ValueError(f"target kind must be one of {', '.join(KINDS)}, got {kind!r}")
        try:
            return Target(dict(target))
        except Exception as err:  # noqa: BLE001 - TVM's message says which key is wrong
            raise ValueError(f"target {target!r} is not a valid TVM target: {err}") from None
    raise TypeError(f"target must be a str, a dict or a tvm.target.Target, got {target!r}")


# What MetaSchedule's VerifyGPUCode checks a CUDA program against (sm_90 limits for
# a block; the shared memory is 48 KB, what a block gets without opting in, on an arch
# without a row in SHARED_MEMORY_PER_BLOCK).
CUDA_LIMITS = {
    "max_threads_per_block": 1024,
    "max_num_threads": 1024,
    "thread_warp_size": 32,
    "max_shared_memory_per_block": 49152,
    "registers_per_block": 65536,
}
# Shared memory a block may opt into, by arch (227 KB on sm_90): TVM's CUDA module
# opts a kernel with more than 48 KB of dynamic shared memory in at launch, and the
# candidates that keep a row or a channel on chip take up to 112 KB ("shared.dyn").
# VerifyGPUCode counts that memory too, so at 48 KB every sample of such a candidate
# failed it: the search could not try one (a tune of CE grad 16384x50257 bf16 spent
# 19 s of host time on the window candidate's task and measured nothing there).
SHARED_MEMORY_PER_BLOCK = {"sm_90": 227 * 1024}


def with_limits(target: Target) -> Target:
    """A CUDA target carrying the per-block limits tuning verifies against."""
    if target.kind.name != "cuda" or "max_threads_per_block" in target.attrs:
        return target
    spec = dict(target.export())
    spec = {k: v for k, v in spec.items() if k not in ("keys", "tag") and v is not None}
    shared = SHARED_MEMORY_PER_BLOCK.get(spec.get("arch", DEFAULT_CUDA_ARCH), CUDA_LIMITS["max_shared_memory_per_block"])
    return Target({**CUDA_LIMITS, "max_shared_memory_per_block": shared, **spec})


def key(target: Target) -> str:
    """Short stable name for caches and log folders, e.g. ``cuda_sm_90``, ``llvm``."""
    if target.kind.name == "cuda":
        return f"cuda_{target.attrs.get('arch', DEFAULT_CUDA_ARCH)}"
    return target.kind.name


def for_device(device_type: str) -> Target:
    return resolve("cuda" if device_type == "cuda" else "llvm")


# Hardware facts by CUDA arch: (SMs, L2 bytes). The sm_90 row is the H200's (132 SMs,
# 60 MiB L2), the GPU the anchor figures come from; it stands in for any arch without
# a row when no GPU is present (code generation on a CPU machine).
CUDA_ARCH_FACTS = {"sm_90": (132, 60 * 2**20)}


def sm_count(target: Any) -> int:
    """Streaming multiprocessors of the GPU a CUDA ``target`` describes: GPU 0's when it
    is of the target's arch, else the arch's row of ``CUDA_ARCH_FACTS`` (TVM's CUDA
    target has no SM-count option)."""
    return _arch_facts(_arch_of(target))[0]


def l2_bytes(target: Any) -> int:
    """L2 cache bytes of a CUDA ``target``: its ``l2_cache_size_bytes`` when set, else
    GPU 0's when it is of the target's arch, else the arch's row of ``CUDA_ARCH_FACTS``."""
    target = resolve(target)
    arch = _arch_of(target)
    given = target.attrs.get("l2_cache_size_bytes")
    return int(given) if given else _arch_facts(arch)[1]


def has_clusters(target: Any) -> bool:
    """Whether a CUDA ``target``'s arch launches thread-block clusters (``sm_90`` and
    later: Hopper's ``barrier.cluster``); False for other kinds."""
    return arch_number(target) >= 90


def arch_number(target: Any) -> int:
    """A CUDA ``target``'s sm_ number (90 for ``sm_90`` and ``sm_90a``); 0 for other kinds."""
    target = resolve(target)
    if target.kind.name != "cuda":
        return 0
    digits = "".join(ch for ch in _arch_of(target).removeprefix("sm_") if ch.isdigit())
    return int(digits) if digits else 0


def _arch_of(target: Any) -> str:
    target = resolve(target)
    if target.kind.name != "cuda":
        raise ValueError(f"GPU facts need a CUDA target, got {target.kind.name}")
    return str(target.attrs.get("arch", DEFAULT_CUDA_ARCH))


@functools.cache
def _arch_facts(arch: str) -> tuple[int, int]:
    """(SMs, L2 bytes) for ``arch``, looked up once: candidates ask on every default."""
    table = CUDA_ARCH_FACTS.get(arch, CUDA_ARCH_FACTS[DEFAULT_CUDA_ARCH])
    gpu = _gpu0()
    if gpu is not None and gpu[0] == arch:
        return gpu[1] or table[0], gpu[2] or table[1]
    return table
