"""GPU: a seeded random sweep of a few hundred problems, every applicable CUDA candidate
with its default knobs and with sampled knobs, plus dispatch's pick through the public
API, each against a float64 reference, outputs poisoned first.

``CASES`` is generated from ``SEED`` alone (pure Python, no GPU, no torch), so test
ids are stable, ``pytest --collect-only`` is the same on every machine and under
pytest-xdist, and a failure replays with ``pytest tests/test_gpu_sweep.py -k <id>``
(its message prints the seed, the case index and that command). One pytest item is
one problem: its data is made once, on the device, from a ``torch.Generator`` seeded
from the case index, and every kernel of the item runs on it. Set
``TVM_FUSION_SWEEP_SEED`` to draw another sweep (other ids, the same counts).

Why each kind of shape is there:

bn_stats (``N_BN_CASES``), every layout the contract reduces to its two views:
* rank 2 (N, C) in both layout spellings, rank 3 (N, C, L) and (N, L, C) (NHWC),
  rank 4 NCHW and NHWC: channels-last inputs go to bn_stats_channels_last (and the
  block-per-channel fallback), the others to split_plane / warp_per_channel /
  block_per_channel, each by its own predicate.
* values per channel of exactly 1 and 2 (the contract: variance 0 for one value, so
  the kernel's shifted sums must give exactly 0 there), short runs, up to about 4M
  (a few channels only: the memory per case stays under ``BN_MAX_NUMEL``): the long
  ones are where float32 accumulation drifts and where the grid-split candidates
  apply; the short ones leave most lanes, warps and splits with nothing to do.
* C from 1 to 4096, primes among them, and H, W, L often prime: no vector width
  divides the plane or the channel row, so the scalar paths run too.
* data with |mean| >> std (fp32: mean +-100, std 0.01; fp16/bf16: as far as their
  spacing allows), where a one-pass sum / sum-of-squares cancels: the candidates'
  ``shifted`` sums (x - x[0]) must stay exact there; also tiny and huge scales.

cross_entropy (``N_CE_CASES``):
* V from 1 (the contract allows any V > 0) to 151936, odd and prime V (no 16-byte
  vector fits the row), V around each candidate's limit (warp_per_row: 4096,
  row_in_shared: 112 KB of row); B from 1 (one block busy) to about 20000, with
  B * V <= ``CE_MAX_ELEMENTS`` (the 2^31-element shapes are test_gpu.py's).
* every option: weight or not, ignore_index -100 (default), 3 (a real class) or -1,
  reduction none / mean / sum, label_smoothing 0, 0.1, 0.3 and 1, int32 and int64
  targets, some rows ignored, and all rows ignored (the mean is NaN, as in torch).
* logits shifted by up to +-40 and scaled up to 8: the log-sum-exp must subtract the
  row max; fp16 / bf16 / fp32.

Tolerances, from the float64 reference on the same quantized input (so the error
is float32 accumulation and exp/log rounding; the GPU code is built with NVRTC's
--use_fast_math):

* bn_stats: the kernels sum ``d = x - K`` (K = the channel's first value) and ``d^2``
  in float32. With ``rel = 4 * bn_atol(dtype, count)`` (helpers: float32 sums of
  ``count`` values drift like sqrt(count) roundings; 4 as in test_gpu.py), a sum of
  positive terms is off by at most ``rel`` times itself, and a sum of d by ``rel``
  times sum |d| <= n sqrt(E[d^2]). So per channel, with E[d^2] = var + (mean - K)^2
  from the float64 reference:
  mean: ``rel * sqrt(E[d^2]) + 4 * 2^-23 * |mean|`` (the final K + S/n rounds once);
  var:  ``3 * rel * E[d^2]`` (E[d^2]/n of sum d^2, and twice E[d]'s error in E[d]^2).
  One value per channel (E[d^2] = 0) must give var exactly 0 and mean exactly x.
* cross_entropy: per row, the float32 loss is off by a few roundings of its terms:
  ``R * log2(V + 2) * S_i`` with ``R = 4 * 2e-5`` (test_gpu.py's scale),
  ``S_i = 1 + 2 * max(w) * |lse_i| + |loss_i|`` (each term of the loss is bounded by
  that, as lse >= x), and 0 for an ignored row, which must be exactly 0. The sum's
  tolerance is the sum of the rows', the mean's that divided by sum w[t].

Knob configurations: every candidate's default knobs always (a build error there
fails the item), and ``sampled`` further configurations per case drawn (seeded) from
``cand.all_configs`` for seeded candidates. A sampled config that the candidate
declines (ValueError), that TVM cannot build, or whose kernel asks for more than 1024
threads a block (``all_configs`` is the tuner's space; the tuner drops those through
VerifyGPUCode) is replaced by the next draw, with a warning; set
``TVM_FUSION_SWEEP_STRICT=1`` to fail on build errors of sampled configs instead.

Cost: each kernel is built once per process (``build_kernel`` caches it, and
dispatch's pick is one of them unless a tuning record says otherwise). A build is
about 0.18 s of TVM code generation (measured over every kernel of the sweep on a
2-core CPU machine, CUDA codegen only) plus, on a GPU host, about 1 s of NVRTC (TVM's
default CUDA compiler there; 0.98 s a kernel measured on that CPU machine with TVM's
own NVRTC options), so ``SWEEP_KERNELS`` kernels take about 20 minutes in one process;
the GPU work itself should take a minute or so. The H200 image has pytest-xdist: run
``python -m pytest -n 8 tests/test_gpu_sweep.py`` (8 processes on one GPU, a few GB of
GPU memory each) for about 3 minutes. Sampled configurations are about a fifth of the
kernels; the defaults alone would still take over 15 minutes in one process.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import re
import warnings

import numpy as np
import pytest

import tvm_fusion as tf
from helpers import assert_close, bn_atol, has_gpu, torch_or_none
from tvm_fusion import registry, targets
from tvm_fusion.kernel import build_kernel

torch = torch_or_none()
# Where data, references and kernels live: "cuda" for the sweep. Only a dry run of the
# harness (the CPU candidates on the same cases) sets "cpu".
DEVICE = "cuda"

SEED = int(os.environ.get("TVM_FUSION_SWEEP_SEED", "20261201"))
N_BN_CASES = 160
N_CE_CASES = 180
CASE_COUNT = N_BN_CASES + N_CE_CASES  # 340 pytest items, one problem each
# Kernels the sweep builds with the default seed, counted by
# test_sweep_cases_are_deterministic_and_cover_every_option (defaults + sampled).
SWEEP_KERNELS = 1208

BN_MAX_NUMEL = 2**25  # 33.5M values: 134 MB of fp32, 268 MB for the float64 reference
BN_MAX_COUNT = 2**22  # about 4M values per channel
CE_MAX_ELEMENTS = 300_000_000  # B * V
MAX_THREADS_PER_BLOCK = 1024
SAMPLE_TRIES = 3  # draws per sampled config before giving up on that candidate
STRICT = os.environ.get("TVM_FUSION_SWEEP_STRICT", "") not in ("", "0")

DTYPES = ("float16", "bfloat16", "float32")
SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
# (tag, rank, layout): NC in both spellings (the contract makes every rank 2 channels-last).
BN_KINDS = (("NC", 2, "NCHW"), ("NC", 2, "NHWC"), ("NCL", 3, "NCHW"), ("NLC", 3, "NHWC"),
            ("NCHW", 4, "NCHW"), ("NHWC", 4, "NHWC"))
PRIMES = (2, 3, 5, 7, 11, 13, 17, 31, 61, 127, 251, 509, 1009, 2039, 4093)
CHANNELS = (1, 2, 3, 4, 7, 8, 13, 16, 31, 32, 61, 64, 96, 127, 128, 192, 251, 256, 384,
            509, 512, 768, 1000, 1021, 1024, 2039, 2048, 3072, 4093, 4096)
SMALL_DIMS = (1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 31, 32, 64, 127, 128, 256)
VOCABS = (1, 2, 3, 4, 5, 7, 8, 10, 16, 31, 37, 100, 127, 128, 257, 511, 1000, 1024, 2047,
          4093, 4096, 4097, 8191, 10007, 16384, 32000, 32003, 50257, 65536, 100003, 128256,
          131071, 151936)
IGNORE_INDICES = (-100, 3, -1)
SMOOTHINGS = (0.0, 0.1, 0.3, 1.0)
REDUCTIONS = ("none", "mean", "sum")
TARGET_DTYPES = ("int32", "int64")


# -- the cases ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    """One problem of the sweep and how its data is drawn."""

    index: int
    op: str
    shape: tuple[int, ...]  # the tensor the caller passes (x, or logits (B, V))
    dtype: str
    options: tuple[tuple[str, object], ...]  # make_problem's keyword options, sorted
    loc: float  # data offset (BN mean, CE logit shift)
    scale: float  # data spread
    ignored: float  # CE: fraction of rows set to ignore_index (1.0: all)
    sampled: int  # knob configurations sampled beyond the defaults
    kind: str = ""  # BN: NC / NCL / NLC / NCHW / NHWC
    data: str = ""  # BN data tag: plain / offset / tiny / large

    @property
    def opts(self) -> dict:
        return dict(self.options)

    @property
    def data_seed(self) -> int:
        return (SEED * 100_003 + self.index) % 2**31

    @property
    def id(self) -> str:
        dims = "x".join(str(d) for d in self.shape)
        if self.op == "bn_stats":
            layout = "-nhwc" if self.kind == "NC" and self.opts["layout"] == "NHWC" else ""
            return f"bn{self.index:03d}-{self.kind}{layout}-{dims}-{SHORT[self.dtype]}-{self.data}"
        o = self.opts
        tags = [o["reduction"], "t32" if o["target_dtype"] == "int32" else "t64"]
        if o["weight"]:
            tags.append("w")
        if o["ignore_index"] != -100:
            tags.append(f"ig{o['ignore_index']}")
        if o["label_smoothing"]:
            tags.append(f"ls{o['label_smoothing']:g}")
        tags.append("allign" if self.ignored >= 1.0 else f"ign{round(100 * self.ignored)}")
        if self.loc:
            tags.append(f"off{self.loc:g}")
        return f"ce{self.index:03d}-{dims}-{SHORT[self.dtype]}-" + "-".join(tags)

    def problem(self):
        return tf.make_problem(self.op, self.shape, self.dtype, **self.opts)

    def replay(self) -> str:
        return (f"sweep case {self.index} ({self.id}), SEED={SEED}, data seed {self.data_seed}: "
                f"{self}\nreplay: TVM_FUSION_SWEEP_SEED={SEED} python -m pytest "
                f"tests/test_gpu_sweep.py -k '{self.id}'")


def _pick(rng: random.Random, weighted: list[tuple[object, float]]):
    total = sum(w for _, w in weighted)
    r = rng.random() * total
    for value, w in weighted:
        r -= w
        if r < 0:
            return value
    return weighted[-1][0]


def _next_prime(n: int) -> int:
    m = max(n, 2)
    while any(m % p == 0 for p in range(2, int(m**0.5) + 1)):
        m += 1
    return m


def _split(rng: random.Random, count: int, parts: int, prime_bias: float) -> list[int]:
    """``parts`` dims whose product is about ``count``: small leading ones (N, H), the
    rest in the last, often bumped to a prime, sometimes shuffled."""
    dims = []
    left = count
    for _ in range(parts - 1):
        options = [d for d in SMALL_DIMS if d <= left]
        d = rng.choice(options) if rng.random() < 0.8 else rng.randint(1, max(1, min(left, 300)))
        dims.append(d)
        left = max(1, left // d)
    last = _next_prime(left) if left > 2 and rng.random() < prime_bias else left
    if math.prod(dims) * last > BN_MAX_COUNT:
        last = left
    dims.append(last)
    if parts > 2 and rng.random() < 0.3:
        rng.shuffle(dims)
    return dims


def _bn_case(rng: random.Random, index: int, force: dict | None = None) -> Case:
    force = force or {}
    tag, rank, layout = force.get("kind") or rng.choice(BN_KINDS)
    dtype = force.get("dtype") or rng.choice(DTYPES)
    regime = force.get("count") or _pick(rng, [("one", 6), ("two", 6), ("short", 20), ("mid", 28),
                                               ("long", 24), ("huge", 16)])
    lo, hi = {"one": (1, 1), "two": (2, 2), "short": (3, 64), "mid": (65, 8192),
              "long": (8193, 262144), "huge": (262145, BN_MAX_COUNT)}[regime]
    count = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
    channels = force.get("channels") or (rng.choice(CHANNELS) if rng.random() < 0.7 else rng.randint(1, 4096))
    parts = rank - 1
    if count <= 2:  # one or two values a channel: every other dim 1
        rest = [1] * parts
        rest[rng.randrange(parts)] = count
    else:
        rest = _split(rng, count, parts, prime_bias=0.35)
    channels = max(1, min(channels, BN_MAX_NUMEL // math.prod(rest)))
    if tag == "NC":
        shape = (rest[0], channels)
    elif tag == "NCL":
        shape = (rest[0], channels, rest[1])
    elif tag == "NLC":
        shape = (rest[0], rest[1], channels)
    elif tag == "NCHW":
        shape = (rest[0], channels, rest[1], rest[2])
    else:
        shape = (rest[0], rest[1], rest[2], channels)
    data = force.get("data") or _pick(rng, [("plain", 55), ("offset", 30), ("tiny", 7.5), ("large", 7.5)])
    sign = rng.choice((-1.0, 1.0))
    if data == "plain":
        loc, scale = round(rng.uniform(-3, 3), 3), round(rng.uniform(0.3, 3.0), 3)
    elif data == "offset":  # |mean| >> std, as far as the dtype's spacing at 100 allows
        loc, scale = sign * 100.0, {"float32": 0.01, "float16": 0.5, "bfloat16": 2.0}[dtype]
    elif data == "tiny":
        loc, scale = round(rng.uniform(-1e-3, 1e-3), 6), 1e-3
    else:
        loc, scale = sign * 1000.0, 100.0
    return Case(index, "bn_stats", tuple(int(d) for d in shape), dtype, (("layout", layout),),
                loc, scale, 0.0, _sampled(rng), tag, data)


def _ce_case(rng: random.Random, index: int, force: dict | None = None) -> Case:
    force = force or {}
    dtype = force.get("dtype") or rng.choice(DTYPES)
    if "classes" in force:
        classes = force["classes"]
    else:
        regime = _pick(rng, [("tiny", 12), ("small", 18), ("mid", 25), ("large", 25), ("huge", 20)])
        lo, hi = {"tiny": (1, 8), "small": (9, 256), "mid": (257, 4097), "large": (4098, 50257),
                  "huge": (50258, 151936)}[regime]
        named = [v for v in VOCABS if lo <= v <= hi]
        classes = rng.randint(lo, hi) if rng.random() < 0.5 else rng.choice(named)
        if classes > 2 and rng.random() < 0.3 and _next_prime(classes) <= hi:
            classes = _next_prime(classes)  # no vector width divides a prime row
    if "batch" in force:
        batch = force["batch"]
    else:
        blo, bhi = _pick(rng, [((1, 1), 10), ((2, 16), 15), ((17, 512), 30), ((513, 4096), 30),
                               ((4097, 20000), 15)])
        batch = int(round(math.exp(rng.uniform(math.log(blo), math.log(bhi)))))
    batch = max(1, min(batch, CE_MAX_ELEMENTS // classes))
    options = {
        "weight": force.get("weight", rng.random() < 0.4),
        "ignore_index": force.get("ignore_index", _pick(rng, [(-100, 60), (3, 20), (-1, 20)])),
        "reduction": force.get("reduction", rng.choice(REDUCTIONS)),
        "label_smoothing": force.get("label_smoothing", _pick(rng, [(0.0, 45), (0.1, 25), (0.3, 20), (1.0, 10)])),
        "target_dtype": force.get("target_dtype", rng.choice(TARGET_DTYPES)),
    }
    ignored = force.get("ignored", _pick(rng, [(0.0, 30), ("some", 60), (1.0, 10)]))
    if ignored == "some":
        ignored = round(rng.uniform(0.05, 0.5), 2)
    loc = force.get("loc", 0.0 if rng.random() < 0.7 else round(rng.choice((-1, 1)) * rng.uniform(5, 40), 1))
    scale = rng.choice((1.0, 2.0, 4.0, 8.0))
    return Case(index, "cross_entropy", (batch, classes), dtype, tuple(sorted(options.items())),
                loc, scale, float(ignored), _sampled(rng))


def _sampled(rng: random.Random) -> int:
    """Sampled knob configurations per case, beyond every candidate's defaults: one in
    about 40% of cases, two in 10% (the build time budget; see the module docstring)."""
    return _pick(rng, [(0, 50), (1, 40), (2, 10)])


# Cases forced at the start so that every edge the docstring names is there whatever
# the seed; the rest are drawn freely.
BN_FORCED = [
    {"count": "one", "channels": 1, "kind": BN_KINDS[2]},
    {"count": "one", "kind": BN_KINDS[5], "dtype": "bfloat16"},
    {"count": "one", "kind": BN_KINDS[0], "dtype": "float16", "data": "offset"},
    {"count": "two", "kind": BN_KINDS[4], "dtype": "float32"},
    {"count": "two", "kind": BN_KINDS[1], "dtype": "float16"},
    {"count": "huge", "kind": BN_KINDS[4], "dtype": "float32", "data": "offset"},
    {"count": "huge", "kind": BN_KINDS[5], "dtype": "bfloat16"},
    {"count": "huge", "kind": BN_KINDS[2], "dtype": "float16", "data": "offset"},
    {"count": "mid", "channels": 4096, "kind": BN_KINDS[5], "dtype": "float16"},
    {"count": "short", "channels": 4093, "kind": BN_KINDS[4], "dtype": "float32"},
    {"count": "long", "channels": 1, "kind": BN_KINDS[3], "dtype": "bfloat16", "data": "offset"},
    {"count": "long", "channels": 3, "kind": BN_KINDS[4], "dtype": "float32", "data": "offset"},
]
CE_FORCED = [
    {"classes": 1, "batch": 1, "reduction": "mean"},
    {"classes": 1, "batch": 777, "weight": True, "label_smoothing": 0.1, "reduction": "none"},
    {"classes": 2, "batch": 1, "dtype": "float32", "reduction": "sum"},
    {"classes": 151936, "batch": 1, "dtype": "bfloat16"},
    {"classes": 151936, "batch": 1500, "dtype": "float16", "label_smoothing": 0.3, "weight": True},
    {"classes": 50257, "batch": 999, "dtype": "bfloat16", "ignore_index": 3},
    {"classes": 1000, "batch": 20000, "ignore_index": -1, "reduction": "none"},
    {"classes": 32003, "batch": 64, "ignored": 1.0, "reduction": "mean"},
    {"classes": 4093, "batch": 333, "ignored": 1.0, "reduction": "sum", "weight": True},
    {"classes": 4097, "batch": 2048, "target_dtype": "int32", "label_smoothing": 1.0},
    {"classes": 100003, "batch": 257, "loc": 35.0, "dtype": "float16"},
    {"classes": 7, "batch": 5, "ignored": 1.0, "reduction": "none", "ignore_index": 3},
]


def generate_cases(seed: int = SEED) -> list[Case]:
    """The sweep: ``N_BN_CASES`` bn_stats and ``N_CE_CASES`` cross_entropy cases."""
    rng = random.Random(seed)
    cases: list[Case] = []
    for i in range(N_BN_CASES):
        cases.append(_bn_case(rng, len(cases), BN_FORCED[i] if i < len(BN_FORCED) else None))
    for i in range(N_CE_CASES):
        cases.append(_ce_case(rng, len(cases), CE_FORCED[i] if i < len(CE_FORCED) else None))
    return cases


CASES = generate_cases()


# -- which kernels a case builds ------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Planned:
    candidate: str
    default: bool
    configs: tuple  # the default knobs, or the sampled draws to try in order


def kernel_plan(case: Case, target) -> list[Planned]:
    """Every applicable candidate with its default knobs, then ``case.sampled`` draws of
    other knobs for seeded candidates (up to SAMPLE_TRIES configs each, in order)."""
    problem = case.problem()
    cands = registry.applicable(problem, target)
    rng = random.Random(f"{SEED}:{case.index}:knobs")
    chosen = {c.name for c in rng.sample(cands, min(case.sampled, len(cands)))}
    plan = []
    for cand in cands:
        default = cand.default_for(problem, target)
        plan.append(Planned(cand.name, True, (default,)))
        if cand.name in chosen:
            others = [k for k in cand.all_configs(problem, target) if k != default]
            random.Random(f"{SEED}:{case.index}:{cand.name}").shuffle(others)
            if others:
                plan.append(Planned(cand.name, False, tuple(others[:SAMPLE_TRIES])))
    return plan


def max_threads_per_block(kernel) -> int:
    """The largest ``__launch_bounds__`` of the kernel's CUDA source (0 if none shown)."""
    try:
        source = kernel.device_source()
    except Exception:  # noqa: BLE001 - a module that shows no source: nothing to check
        return 0
    return max((int(n) for n in re.findall(r"__launch_bounds__\((\d+)\)", source)), default=0)


def build_planned(case: Case, planned: Planned, target, notes: list[str]):
    """(kernel, knobs) for one plan entry, or None when no sampled draw builds. A default
    config's error propagates; a sampled one's is noted and the next draw tried."""
    problem = case.problem()
    if planned.default:
        return build_kernel(problem, target, planned.candidate, planned.configs[0]), planned.configs[0]
    for knobs in planned.configs:
        try:
            kernel = build_kernel(problem, target, planned.candidate, knobs)
        except Exception as err:  # noqa: BLE001 - a config of the space that gives no kernel
            message = str(err).strip()
            if isinstance(err, ValueError) and ("does not apply" in message or "declined" in message):
                notes.append(f"{planned.candidate} [{knobs}] declined: {message[:200]}")
                continue
            if STRICT:
                raise
            last = message.splitlines()[-1:] or [""]
            notes.append(f"{planned.candidate} [{knobs}] does not build: {type(err).__name__}: {last[0][:200]}")
            continue
        threads = max_threads_per_block(kernel)
        if threads > MAX_THREADS_PER_BLOCK:
            notes.append(f"{planned.candidate} [{knobs}] wants {threads} threads a block: skipped")
            continue
        return kernel, knobs
    return None


# -- running ---------------------------------------------------------------------------
def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def run_poisoned(kernel, inputs, float_fill: float = float("nan")):
    """Launch with NaN-poisoned float outputs and -7777 int outputs (as test_gpu.run_kernel):
    an element the kernel never writes fails the comparison. Where the expected loss is
    NaN (a mean over no valid row), the floats are poisoned with +inf instead."""
    import contextlib

    import tvm_ffi

    args = [tvm_ffi.from_dlpack(t)._create_view(shape) for t, (_, shape, _) in zip(inputs, kernel.params)]
    outs = []
    for _, shape, dtype in kernel.outputs:
        fill = -7777 if dtype.startswith("int") else float_fill
        outs.append(torch.full(shape, fill, dtype=getattr(torch, dtype), device=DEVICE))
    with tvm_ffi.use_torch_stream() if DEVICE == "cuda" else contextlib.nullcontext():
        kernel(*args, *(tvm_ffi.from_dlpack(o) for o in outs))
    sync()
    return [o.cpu().numpy() for o in outs]


def poison_allocator(nbytes: list[int], byte: int = 0xFF) -> None:
    """Best effort for the public API, whose outputs come from torch's caching allocator
    (torch.empty): leave freed blocks of the outputs' sizes filled with ``byte`` (0xFF: a
    float32 NaN and an int32 -1, which the target check reports; 0x7F: 3.4e38, for an
    expected NaN), so that an output the kernel does not write is most likely garbage,
    not an earlier call's right answer."""
    blocks = [torch.full((max(n, 1),), byte, dtype=torch.uint8, device=DEVICE) for n in nbytes]
    sync()
    del blocks


# -- bn_stats ---------------------------------------------------------------------------
def bn_data(case: Case):
    gen = torch.Generator(device=DEVICE).manual_seed(case.data_seed)
    x = torch.randn(case.shape, generator=gen, device=DEVICE, dtype=torch.float32)
    return (x * case.scale + case.loc).to(getattr(torch, case.dtype))


def bn_reference(x, problem) -> dict[str, np.ndarray]:
    """float64 mean and var per channel, and the tolerances the module docstring derives."""
    view = x.double().reshape(problem.shape)
    dims = (0,) if problem.channels_last else (0, 2)
    var, mean = torch.var_mean(view, dim=dims, correction=0)
    shift = view[0] if problem.channels_last else view[0, :, 0]
    second = var + (mean - shift) ** 2  # E[(x - K)^2], what the float32 sums carry
    rel = 4 * bn_atol(problem.dtype, problem.count)
    mean, var, second = (t.cpu().numpy() for t in (mean, var, second))
    return {
        "mean": mean,
        "var": var,
        "mean_atol": rel * np.sqrt(second) + 4 * 2.0**-23 * np.abs(mean),
        "var_atol": 3 * rel * second,
    }


def check_bn(outputs, ref, what: str) -> None:
    mean, var = (np.asarray(o, np.float64).reshape(-1) for o in outputs[:2])
    assert_close(mean, ref["mean"], 0.0, ref["mean_atol"], f"{what}: mean")
    assert_close(var, ref["var"], 0.0, ref["var_atol"], f"{what}: var")


def run_every_kernel(case: Case, target, failures: list[str], notes: list[str], check) -> None:
    """Build and ``check(kernel, label)`` every planned kernel of the case; a failure is
    collected, not raised, so that every kernel of the case runs."""
    for planned in kernel_plan(case, target):
        label = f"{planned.candidate} ({'default' if planned.default else 'sampled'} knobs)"
        try:
            built = build_planned(case, planned, target, notes)
            if built is None:
                continue
            kernel, knobs = built
            label = f"{planned.candidate} [{knobs}]"
            check(kernel, label)
        except Exception as err:  # noqa: BLE001 - collected: every kernel of the case runs
            failures.append(f"{label}: {type(err).__name__}: {err}")


def sweep_bn(case: Case, target, failures: list[str], notes: list[str]) -> None:
    problem = case.problem()
    x = bn_data(case)
    ref = bn_reference(x, problem)
    run_every_kernel(case, target, failures, notes, lambda kernel, label: check_bn(run_poisoned(kernel, [x]), ref, label))
    layout = case.opts["layout"]
    try:
        poison_allocator([4 * problem.channels] * 2)
        outputs = tf.bn_stats(x) if layout == "NCHW" else tf.bn_stats(x, layout=layout)
        sync()
        assert all(o.device.type == DEVICE and o.dtype == torch.float32 for o in outputs)
        check_bn([o.cpu().numpy() for o in outputs], ref, "tf.bn_stats (dispatch)")
    except Exception as err:  # noqa: BLE001
        failures.append(f"tf.bn_stats (dispatch): {type(err).__name__}: {err}")


# -- cross_entropy -----------------------------------------------------------------------
def ce_data(case: Case):
    o = case.opts
    batch, classes = case.shape
    gen = torch.Generator(device=DEVICE).manual_seed(case.data_seed)
    logits = torch.randn(case.shape, generator=gen, device=DEVICE, dtype=torch.float32)
    logits = (logits * case.scale + case.loc).to(getattr(torch, case.dtype))
    target = torch.randint(0, classes, (batch,), generator=gen, device=DEVICE, dtype=torch.int64)
    drop = torch.rand(batch, generator=gen, device=DEVICE) < case.ignored
    if case.ignored >= 1.0:
        drop[:] = True
    target[drop] = o["ignore_index"]
    target = target.to(getattr(torch, o["target_dtype"]))
    weight = torch.rand(classes, generator=gen, device=DEVICE) + 0.5 if o["weight"] else None
    return logits, target, weight


def ce_reference(case: Case, logits, target, weight) -> dict:
    """torch's cross entropy in float64 on the device, a block of rows at a time, and the
    per-row tolerance scale S_i of the module docstring."""
    o = case.opts
    F = torch.nn.functional
    batch, classes = case.shape
    w = None if weight is None else weight.double()
    rows = max(1, 2**25 // classes)
    losses, lses = [], []
    for i in range(0, batch, rows):
        block = logits[i : i + rows].double()
        losses.append(F.cross_entropy(block, target[i : i + rows].long(), w, ignore_index=o["ignore_index"],
                                      reduction="none", label_smoothing=o["label_smoothing"]))
        lses.append(torch.logsumexp(block, dim=1))
    loss, lse = torch.cat(losses), torch.cat(lses)
    t = target.long()
    valid = t != o["ignore_index"]
    w_max = 1.0 if w is None else float(w.max())
    scale = torch.where(valid, 1 + 2 * w_max * lse.abs() + loss.abs(), torch.zeros_like(loss))
    w_t = torch.ones_like(loss) if w is None else w[t.clamp(0, classes - 1)]
    denom = torch.where(valid, w_t, torch.zeros_like(w_t)).sum()
    r = 4 * 2e-5 * math.log2(classes + 2)
    out = {"none": loss.cpu().numpy(), "none_atol": (r * scale).cpu().numpy()}
    out["sum"], out["sum_atol"] = loss.sum().item(), r * scale.sum().item()
    out["mean"] = (loss.sum() / denom).item()  # 0 / 0 = NaN: no valid row
    out["mean_atol"] = out["sum_atol"] / denom.item() if denom.item() > 0 else 0.0
    return out


def check_ce_loss(loss, ref, reduction: str, what: str) -> None:
    loss = np.asarray(loss, np.float64).reshape(-1)
    if reduction == "none":
        assert_close(loss, ref["none"], 0.0, ref["none_atol"], f"{what}: loss (none)")
    else:
        expected = np.array([ref[reduction]])
        assert_close(loss, expected, 0.0, ref[f"{reduction}_atol"], f"{what}: loss ({reduction})")


def check_ce_kernel(outputs, ref, case: Case, what: str) -> None:
    reduction = case.opts["reduction"]
    batch = case.shape[0]
    first_bad = int(np.asarray(outputs[-1]).reshape(-1)[0])
    assert first_bad == batch, f"{what}: first_bad_row = {first_bad}, expected B = {batch} (no bad target)"
    if reduction != "none":  # (row_loss, loss, first_bad_row): the per-row losses too
        assert_close(np.asarray(outputs[0], np.float64), ref["none"], 0.0, ref["none_atol"], f"{what}: row_loss")
    check_ce_loss(outputs[-2], ref, reduction, what)


def sweep_ce(case: Case, target, failures: list[str], notes: list[str]) -> None:
    o = case.opts
    logits, target_t, weight = ce_data(case)
    ref = ce_reference(case, logits, target_t, weight)
    inputs = [logits, target_t] + ([weight] if weight is not None else [])
    expect_nan = o["reduction"] == "mean" and math.isnan(ref["mean"])
    fill = float("inf") if expect_nan else float("nan")
    run_every_kernel(case, target, failures, notes,
                     lambda kernel, label: check_ce_kernel(run_poisoned(kernel, inputs, fill), ref, case, label))
    kwargs = {k: o[k] for k in ("ignore_index", "reduction", "label_smoothing")
              if o[k] != {"ignore_index": -100, "reduction": "mean", "label_smoothing": 0.0}[k]}
    batch = case.shape[0]
    sizes = [4 * batch, 4, 4]  # row_loss or loss (B,), loss (1,), first_bad_row (1,)
    for check in (False, True):
        what = f"tf.cross_entropy (dispatch, check_targets={check})"
        try:
            poison_allocator(sizes, 0x7F if expect_nan else 0xFF)
            if check:
                loss = tf.cross_entropy(logits, target_t, weight, **kwargs)
                if hasattr(tf, "check_targets"):
                    tf.check_targets()  # CUDA defers the flag: a garbage one raises here
            else:
                loss = tf.cross_entropy(logits, target_t, weight, check_targets=False, **kwargs)
            sync()
            expected_shape = (batch,) if o["reduction"] == "none" else ()
            assert tuple(loss.shape) == expected_shape, f"shape {tuple(loss.shape)} != {expected_shape}"
            assert loss.device.type == DEVICE and loss.dtype == torch.float32
            check_ce_loss(loss.cpu().numpy(), ref, o["reduction"], what)
        except Exception as err:  # noqa: BLE001
            failures.append(f"{what}: {type(err).__name__}: {err}")


# -- the tests ----------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_sweep_case_on_gpu(case):
    target = targets.resolve("cuda")
    failures: list[str] = []
    notes: list[str] = []
    try:
        (sweep_bn if case.op == "bn_stats" else sweep_ce)(case, target, failures, notes)
    except Exception as err:  # noqa: BLE001 - the data or the reference: name the case
        failures.append(f"case setup: {type(err).__name__}: {err}")
    if notes:
        warnings.warn(f"{case.id}: sampled knobs skipped: " + "; ".join(notes), stacklevel=1)
    if failures:
        pytest.fail(f"{case.replay()}\n{len(failures)} failure(s):\n\n" + "\n\n".join(failures), pytrace=False)


def test_sweep_cases_are_deterministic_and_cover_every_option():
    """The generator (no GPU): the same cases twice, the documented count, every op,
    layout, dtype and option at least once, memory bounds kept, and the number of
    kernels the sweep builds (with the sm_90 target the H200 resolves to)."""
    again = generate_cases()
    assert again == CASES
    assert [c.id for c in again] == [c.id for c in CASES]
    assert len(CASES) == CASE_COUNT and 300 <= CASE_COUNT <= 400
    assert len({c.id for c in CASES}) == len(CASES), "test ids must be unique"
    assert generate_cases(SEED + 1) != CASES  # the seed matters

    bn = [c for c in CASES if c.op == "bn_stats"]
    ce = [c for c in CASES if c.op == "cross_entropy"]
    assert len(bn) == N_BN_CASES and len(ce) == N_CE_CASES
    for c in bn:
        problem = c.problem()  # the contract accepts it
        assert problem.numel <= BN_MAX_NUMEL and problem.count <= BN_MAX_COUNT, c
        assert len(c.shape) == {"NC": 2, "NCL": 3, "NLC": 3, "NCHW": 4, "NHWC": 4}[c.kind], c
    assert {(c.kind, c.opts["layout"]) for c in bn} == {(t, lay) for t, _, lay in BN_KINDS}
    assert {c.dtype for c in bn} == set(DTYPES)
    assert {(c.dtype, c.data) for c in bn if c.data == "offset"} == {(d, "offset") for d in DTYPES}
    assert {c.data for c in bn} == {"plain", "offset", "tiny", "large"}
    counts = [c.problem().count for c in bn]
    assert 1 in counts and 2 in counts and max(counts) >= 2**21 and any(3 <= n <= 64 for n in counts)
    channels = [c.problem().channels for c in bn]
    assert min(channels) == 1 and max(channels) >= 4093
    assert any(c.problem().channels in PRIMES and c.problem().channels > 2 for c in bn)

    for c in ce:
        c.problem()
        assert c.shape[0] * c.shape[1] <= CE_MAX_ELEMENTS, c
    opts = [c.opts for c in ce]
    assert {c.dtype for c in ce} == set(DTYPES)
    assert {o["weight"] for o in opts} == {False, True}
    assert {o["ignore_index"] for o in opts} == set(IGNORE_INDICES)
    assert {o["reduction"] for o in opts} == set(REDUCTIONS)
    assert {o["label_smoothing"] for o in opts} == set(SMOOTHINGS)
    assert {o["target_dtype"] for o in opts} == set(TARGET_DTYPES)
    classes = [c.shape[1] for c in ce]
    batches = [c.shape[0] for c in ce]
    assert 1 in classes and max(classes) == 151936 and any(v in PRIMES or v in (10007, 32003, 100003, 131071)
                                                           for v in classes)
    assert sum(v % 2 for v in classes) >= 20, "odd vocabularies"
    assert 1 in batches and max(batches) >= 10000
    assert any(0 < c.ignored < 1 for c in ce) and any(c.ignored == 0 for c in ce)
    assert any(c.ignored >= 1 and c.opts["reduction"] == "mean" for c in ce), "all ignored: mean NaN"
    assert any(c.loc != 0 for c in ce)
    assert {c.sampled for c in CASES} == {0, 1, 2}

    sm90 = targets.resolve({"kind": "cuda", "arch": "sm_90"})
    kernels = 0
    for c in CASES:
        plan = kernel_plan(c, sm90)
        assert any(p.default for p in plan), f"no CUDA candidate applies to {c.id}"
        assert plan == kernel_plan(c, sm90)
        kernels += len(plan)
    print(f"{len(CASES)} cases, {kernels} kernels (defaults and first sampled draws)")
    # The documented figure, within 25% (the registry moves on): when this fails, update
    # SWEEP_KERNELS and the docstring's build-time estimate.
    assert abs(kernels - SWEEP_KERNELS) <= 0.25 * SWEEP_KERNELS, kernels


def test_sweep_checks_catch_unwritten_and_wrong_outputs(monkeypatch):
    """The harness itself, on the CPU (no GPU): the references and checks of a few small
    cases pass the CPU candidates and the public API, and fail a poisoned (unwritten)
    output and a slightly wrong one."""
    if torch is None:
        pytest.skip("torch not installed")
    import sys

    monkeypatch.setattr(sys.modules[__name__], "DEVICE", "cpu")
    cpu = targets.resolve("llvm")
    small = [c for c in CASES if c.problem().numel <= 20_000]
    wanted = [
        lambda c: c.op == "bn_stats" and c.data == "offset" and c.problem().count > 2,
        lambda c: c.op == "bn_stats" and c.problem().count == 1,
        lambda c: c.op == "cross_entropy" and c.opts["reduction"] == "none" and c.opts["weight"]
        and c.opts["label_smoothing"] > 0 and 0 < c.ignored < 1,
        lambda c: c.op == "cross_entropy" and c.opts["reduction"] == "mean" and c.ignored >= 1,
        lambda c: c.op == "cross_entropy" and c.opts["reduction"] == "sum" and c.shape[1] > 2,
    ]
    picks = [c for c in (next((c for c in small if want(c)), None) for want in wanted) if c is not None]
    assert len(picks) >= 3
    for case in picks:
        print(case.id)
        failures, notes = [], []
        (sweep_bn if case.op == "bn_stats" else sweep_ce)(case, cpu, failures, notes)
        assert not failures, f"{case.replay()}\n" + "\n".join(failures)

        problem = case.problem()
        if case.op == "bn_stats":
            ref = bn_reference(bn_data(case), problem)
            good = [ref["mean"].astype(np.float32), ref["var"].astype(np.float32)]
            check_bn(good, ref, "float32-rounded reference")
            for i in range(2):
                with pytest.raises(AssertionError):
                    check_bn([np.full_like(o, np.nan) if j == i else o for j, o in enumerate(good)], ref, "poisoned")
            spread = np.sqrt(ref["var"] + 1e-30)
            with pytest.raises(AssertionError):
                check_bn([good[0] + (1e-3 * spread + 1e-6 * np.abs(good[0])).astype(np.float32), good[1]], ref, "off")
            continue
        logits, target_t, weight = ce_data(case)
        ref = ce_reference(case, logits, target_t, weight)
        reduction, batch = case.opts["reduction"], case.shape[0]
        loss = ref["none"] if reduction == "none" else np.array([ref[reduction]])
        rows = [ref["none"].astype(np.float32)] if reduction != "none" else []
        good = rows + [loss.astype(np.float32), np.array([batch], np.int32)]
        check_ce_kernel(good, ref, case, "float32-rounded reference")
        poison = float("inf") if reduction == "mean" and math.isnan(ref["mean"]) else float("nan")
        for i in range(len(good)):
            bad = [np.full_like(o, -7777 if o.dtype.kind == "i" else poison) if j == i else o for j, o in enumerate(good)]
            with pytest.raises(AssertionError):
                check_ce_kernel(bad, ref, case, "poisoned")
        if not math.isnan(loss[0]):
            wrong = good[:-2] + [good[-2] + np.float32(1e-2) * (1 + np.abs(good[-2])), good[-1]]
            with pytest.raises(AssertionError):
                check_ce_kernel(wrong, ref, case, "off")
