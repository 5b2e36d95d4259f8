"""``tvm-fusion bench``: every candidate, the default pick and the peers, side by side.

One process, one run: a device-to-device copy gives the bandwidth ceiling, then for
each shape every provider is checked against a float64 reference (a wrong result is
reported, never timed) and timed with CUDA graph replay (CUDA events around a graph
of launches, median of repeats; inputs rotated so the working set is several times
the L2), or with ``time.perf_counter`` on the CPU. Beside the kernels, the ``api``
rows (``tvm_fusion api``, ``torch eager api``, ...) time what a user gets: the public
call itself, back to back without a graph, argument checks, dispatch and host syncs
included. It prints a table (ms, GB/s, fraction of copy bandwidth, speed-up over the
best peer of the same kind), appends rows to the results CSV and draws one bar
chart of the kernels per operator. How things are timed lives in
:mod:`tvm_fusion.timing`.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import math
import os
import platform
import re
import subprocess
from collections.abc import Callable
from typing import Any

import numpy as np

from . import __version__, registry, targets
from .api import make_problem
from .compute import prim_func
from .contracts import BNStatsProblem
from .contracts import bn_stats as bn_contract
from .contracts import cross_entropy as ce_contract
from .dispatch import choose
from .kernel import Kernel, build_kernel
from .timing import (
    copies_for, copy_bandwidth_cpu, copy_bandwidth_gpu, empty_launch_gpu, time_calls_cpu, time_calls_gpu,
    time_cpu, time_gpu,
)

CSV_FIELDS = [
    "hardware", "date", "version", "op", "shape", "dtype", "options", "provider",
    "median_ms", "gb_s", "frac_copy", "method", "status",
]
RESULTS_DIR = "results"
CSV_NAME = "benchmarks.csv"
PEERS = ("torch eager", "torch.compile", "TVM DLight", "Liger", "Quack")
API = " api"  # suffix of the providers timed as the user's call, e.g. "torch eager api"


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    shape: tuple[int, ...]
    dtype: str
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def problem(self):
        return make_problem(self.op, self.shape, self.dtype, **dict(self.options))

    @property
    def layout(self) -> str:
        """bn_stats' layout argument (an option; NCHW unless the case says NHWC)."""
        return dict(self.options).get("layout", "NCHW")

    def label(self) -> str:
        dims = "x".join(map(str, self.shape))
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        return f"{self.op} {dims} {self.dtype}" + (f" {opts}" if opts else "")


# The nine shapes of the README's results table: the anchor figures were measured on
# these, and tuning_logs/cuda_sm_90 holds a record for each.
GPU_CASES = [
    Case("bn_stats", (64, 256, 56, 56), "float16"),
    Case("bn_stats", (32, 64, 112, 112), "float16"),
    Case("bn_stats", (256, 2048, 7, 7), "float16"),
    Case("bn_stats", (8, 3, 224, 224), "float16"),
    Case("cross_entropy", (4096, 32000), "float16"),
    Case("cross_entropy", (8192, 128256), "bfloat16"),
    Case("cross_entropy", (65536, 1000), "float16"),
    Case("cross_entropy", (16384, 50257), "bfloat16"),
    Case("cross_entropy", (128, 32000), "float16"),
]
# Benched beside the table, without a shipped tuning record (dispatch's heuristic pick):
# channels-last BN at a ResNet-50 stage-1 size in bfloat16.
GPU_EXTRA_CASES = [
    Case("bn_stats", (128, 56, 56, 256), "bfloat16", (("layout", "NHWC"),)),
]
# The CPU comparison: numpy (and torch, for the api rows) doing the same work on the
# same inputs.
CPU_CASES = [
    Case("bn_stats", (64, 256, 56, 56), "float32"),
    Case("cross_entropy", (4096, 32000), "float32"),
]


@dataclasses.dataclass
class Result:
    case: Case
    provider: str
    median_ms: float | None
    bytes_moved: int
    method: str
    status: str  # "ok", "wrong: ...", "failed: ...", "skipped: ..."

    @property
    def gb_s(self) -> float | None:
        return None if not self.median_ms or not self.bytes_moved else self.bytes_moved / (self.median_ms * 1e-3) / 1e9


# -- environment ---------------------------------------------------------------------
def gpu_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def hardware_name(on_gpu: bool) -> str:
    if on_gpu:
        import torch

        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    except OSError:
        pass
    return platform.processor() or "cpu"


def version_string() -> str:
    import tvm

    sha = os.environ.get("TVM_FUSION_REVISION", "")  # set where the copy's .git is stale (the GPU host)
    if not sha:
        try:
            sha = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                cwd=os.path.dirname(os.path.abspath(__file__)),
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            pass
    return f"tvm_fusion {__version__}{'+' + sha if sha else ''} / tvm {tvm.__version__}"


# -- data and references ---------------------------------------------------------------
def make_inputs(case: Case, gen: np.random.Generator) -> dict[str, np.ndarray]:
    """Fresh random host inputs (never zeros); CE gets ~5% ignored rows."""
    import ml_dtypes

    np_dtype = ml_dtypes.bfloat16 if case.dtype == "bfloat16" else np.dtype(case.dtype)
    problem = case.problem
    if isinstance(problem, BNStatsProblem):
        x = (gen.standard_normal(problem.input_shape, dtype=np.float32) * 1.5 + 0.25).astype(np_dtype)
        return {"x": x}
    logits = (gen.standard_normal(problem.shape, dtype=np.float32) * 2.0).astype(np_dtype)
    target = gen.integers(0, problem.classes, problem.batch).astype(problem.target_dtype)
    target[gen.random(problem.batch) < 0.05] = problem.ignore_index
    out = {"logits": logits, "target": target}
    if problem.has_weight:
        out["weight"] = (gen.random(problem.classes) + 0.5).astype(np.float32)
    return out


def device_inputs(case: Case) -> dict[str, Any]:
    """Fresh random inputs made on the GPU by torch (the big shapes are GBs)."""
    import torch

    problem = case.problem
    dtype = getattr(torch, case.dtype)
    if isinstance(problem, BNStatsProblem):
        x = torch.randn(problem.input_shape, device="cuda") * 1.5 + 0.25
        return {"x": x.to(dtype)}
    logits = (torch.randn(problem.shape, device="cuda") * 2.0).to(dtype)
    target = torch.randint(0, problem.classes, (problem.batch,), device="cuda",
                           dtype=getattr(torch, problem.target_dtype))
    target[torch.rand(problem.batch, device="cuda") < 0.05] = problem.ignore_index
    out = {"logits": logits, "target": target}
    if problem.has_weight:
        out["weight"] = torch.rand(problem.classes, device="cuda") + 0.5
    return out


def host_reference(case: Case, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    problem = case.problem
    if isinstance(problem, BNStatsProblem):
        return list(bn_contract.reference(inputs["x"], problem.layout))
    o = dict(case.options)
    return [np.asarray(ce_contract.reference(
        inputs["logits"], inputs["target"], inputs.get("weight"), o.get("ignore_index", -100),
        o.get("reduction", "mean"), o.get("label_smoothing", 0.0),
    ))]


def torch_reference(case: Case, t: dict[str, Any]) -> list[Any]:
    """Float64 reference computed by torch on the device (fast for the big shapes)."""
    import torch
    import torch.nn.functional as F

    problem = case.problem
    if isinstance(problem, BNStatsProblem):
        x = t["x"].double().reshape(problem.shape)
        dims = (0,) if problem.channels_last else (0, 2)
        var, mean = torch.var_mean(x, dim=dims, correction=0)
        return [mean, var]
    o = dict(case.options)
    weight = t.get("weight")
    loss = F.cross_entropy(
        t["logits"].double(), t["target"].long(), None if weight is None else weight.double(),
        ignore_index=o.get("ignore_index", -100), reduction=o.get("reduction", "mean"),
        label_smoothing=o.get("label_smoothing", 0.0),
    )
    return [loss.reshape(-1) if loss.dim() == 0 else loss]


def error_scales(case: Case, reference: list[np.ndarray]) -> list[float | None]:
    """What an error is measured against: BN's mean against the spread (std), its
    variance against the largest variance; a loss against itself (None)."""
    if case.op == "bn_stats":
        var = np.asarray(reference[1], np.float64)
        return [float(np.sqrt(var.max())), float(var.max())]
    return [None]


def close(actual: np.ndarray, expected: np.ndarray, rtol: float, scale: float | None = None) -> tuple[bool, float]:
    actual = np.asarray(actual, np.float64).reshape(np.shape(expected))
    expected = np.asarray(expected, np.float64)
    if not np.array_equal(np.isnan(actual), np.isnan(expected)):
        return False, math.inf
    mask = ~np.isnan(expected)
    err = np.abs(actual[mask] - expected[mask])
    denom = np.maximum(np.abs(expected[mask]), 1e-3) if scale is None else max(scale, 1e-12)
    worst = float(np.max(err / denom)) if err.size else 0.0
    return worst <= rtol, worst


# -- providers -----------------------------------------------------------------------
@dataclasses.dataclass
class Provider:
    """A way to compute the case: launches over the rotated inputs, and the results of
    the first launch (after it ran) for the correctness check."""

    name: str
    launches: list[Callable[[], None]]
    results: Callable[[], list[np.ndarray]]
    rtol: float
    graphable: bool = True  # False: never capture (it syncs, e.g. Liger's .item())
    api: bool = False  # True: the user's call, timed back to back without a graph
    skip_note: str = ""  # a known limitation: a failure is reported as skipped, with this


def _tvm_provider(name: str, kernel: Kernel, case: Case, sets: list[dict[str, Any]], on_gpu: bool) -> Provider:
    import tvm
    import tvm_ffi

    dev = tvm.cuda(0) if on_gpu else tvm.cpu(0)
    shapes = [shape for _, shape, _ in kernel.params[: kernel.num_inputs]]
    calls, first_outs = [], None
    for data in sets:
        args = []
        for value, shape in zip(data.values(), shapes):
            t = tvm_ffi.from_dlpack(value) if on_gpu else tvm.runtime.tensor(value, dev)
            args.append(t._create_view(shape))
        outs = [tvm.runtime.empty(shape, dtype, dev) for _, shape, dtype in kernel.outputs]
        first_outs = first_outs or outs
        calls.append(lambda args=args, outs=outs: kernel(*args, *outs))

    def results():
        # The first output(s) a user reads: (mean, var) or the loss.
        chosen = first_outs[:2] if kernel.problem.op == "bn_stats" else [first_outs[-2]]
        return [o.numpy() for o in chosen]

    return Provider(name, calls, results, rtol=1e-4)


def _dlight_kernel(case: Case, target) -> Kernel:
    """TVM's default GPU schedules (DLight) for the same compute: the TVM baseline."""
    import tvm
    from tvm.s_tir import dlight as dl

    algorithm = "one_pass" if case.op == "bn_stats" else "three_pass"
    mod = tvm.IRModule({"main": prim_func(case.problem, algorithm)})
    with target:
        mod = dl.ApplyDefaultSchedule(dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback())(mod)
        ex = tvm.compile(mod, target=target)
    return Kernel(case.problem, target, "dlight_default", registry.Knobs(), "dlight", mod, ex)


def _torch_providers(case: Case, torch_sets: list[dict[str, Any]]) -> list[Provider]:
    import torch
    import torch.nn.functional as F

    problem = case.problem
    o = dict(case.options)
    providers = []
    if isinstance(problem, BNStatsProblem):
        if problem.channels_last and len(problem.input_shape) == 4:
            views = [s["x"].permute(0, 3, 1, 2) for s in torch_sets]  # channels_last memory
        else:
            views = [s["x"].reshape(problem.input_shape[0], problem.channels, -1) if problem.channels_last is False else s["x"] for s in torch_sets]
        dims = tuple(d for d in range(views[0].dim()) if d != 1)
        eps = 1e-5
        holder: dict[str, Any] = {}

        def eager(v):
            mean, invstd = torch.batch_norm_stats(v, eps)
            holder.setdefault("eager", (mean, invstd))

        def eager_results():
            mean, invstd = holder["eager"]
            return [mean.double().cpu().numpy(), (1.0 / invstd.double() ** 2 - eps).cpu().numpy()]

        providers.append(Provider("torch eager", [lambda v=v: eager(v) for v in views], eager_results, rtol=2e-3))
        compiled = torch.compile(lambda v: torch.var_mean(v.float(), dim=dims, correction=0), dynamic=False)

        def compiled_run(v, first):
            var, mean = compiled(v)
            if first:
                holder["compile"] = (mean, var)

        providers.append(Provider(
            "torch.compile", [lambda v=v, i=i: compiled_run(v, i == 0) for i, v in enumerate(views)],
            lambda: [t.double().cpu().numpy() for t in holder["compile"]], rtol=2e-3,
        ))
        return providers

    kwargs = dict(ignore_index=o.get("ignore_index", -100), reduction=o.get("reduction", "mean"),
                  label_smoothing=o.get("label_smoothing", 0.0))
    holder = {}

    def ce_eager(s, first):
        loss = F.cross_entropy(s["logits"], s["target"], s.get("weight"), **kwargs)
        if first:
            holder["eager"] = loss

    rtol = _peer_rtol(case.dtype)
    providers.append(Provider(
        "torch eager", [lambda s=s, i=i: ce_eager(s, i == 0) for i, s in enumerate(torch_sets)],
        lambda: [holder["eager"].double().cpu().numpy().reshape(-1)], rtol,
    ))
    compiled = torch.compile(lambda x, t: F.cross_entropy(x, t, **kwargs), dynamic=False)

    def ce_compiled(s, first):
        loss = compiled(s["logits"], s["target"])
        if first:
            holder["compile"] = loss

    if "weight" not in torch_sets[0]:
        providers.append(Provider(
            "torch.compile", [lambda s=s, i=i: ce_compiled(s, i == 0) for i, s in enumerate(torch_sets)],
            lambda: [holder["compile"].double().cpu().numpy().reshape(-1)], rtol,
        ))
    try:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
    except ImportError:
        LigerCrossEntropyFunction = None
    if LigerCrossEntropyFunction is not None and o.get("reduction", "mean") == "mean" and "weight" not in torch_sets[0]:
        # Liger writes the gradient over the logits in place: give it its own copies.
        liger_sets = [s["logits"].clone() for s in torch_sets]
        fresh = torch_sets[0]["logits"].clone()

        def liger(x, t, first):
            loss = LigerCrossEntropyFunction.apply(x, t, None, kwargs["ignore_index"], 0.0, kwargs["label_smoothing"], "mean")
            loss = loss[0] if isinstance(loss, tuple) else loss
            if first:
                holder["liger"] = loss

        def liger_results():
            x = fresh.clone()
            loss = LigerCrossEntropyFunction.apply(x, torch_sets[0]["target"], None, kwargs["ignore_index"], 0.0, kwargs["label_smoothing"], "mean")
            loss = loss[0] if isinstance(loss, tuple) else loss
            return [loss.double().cpu().numpy().reshape(-1)]

        providers.append(Provider(
            "Liger", [lambda x=x, s=s, i=i: liger(x, s["target"], i == 0) for i, (x, s) in enumerate(zip(liger_sets, torch_sets))],
            liger_results, rtol, graphable=False,
        ))
    quack = _quack_forward(case, torch_sets[0])
    if quack is not None:
        forward, note = quack

        def quack_run(s, first):
            loss = _reduced(forward(s["logits"], s["target"], ignore_index=kwargs["ignore_index"]),
                            s["target"], kwargs["reduction"], kwargs["ignore_index"])
            if first:
                holder["quack"] = loss

        providers.append(Provider(
            "Quack", [lambda s=s, i=i: quack_run(s, i == 0) for i, s in enumerate(torch_sets)],
            lambda: [holder["quack"].double().cpu().numpy().reshape(-1)], rtol, skip_note=note,
        ))
    return providers


def _quack_forward(case: Case, first: dict[str, Any]) -> tuple[Callable, str] | None:
    """Quack's forward kernel (per-row losses) when ``import quack`` works and the case
    is one it computes (no weight, no label smoothing), with the note a failure gets:
    its kernels fail on an odd V."""
    if case.op != "cross_entropy" or "weight" in first or dict(case.options).get("label_smoothing", 0.0):
        return None
    try:
        from quack.cross_entropy import cross_entropy_fwd
    except Exception:  # noqa: BLE001 - not installed, or no CUDA DSL runtime here
        return None
    classes = case.problem.classes
    return cross_entropy_fwd, (f"Quack fails on an odd V ({classes})" if classes % 2 else "")


def _reduced(loss: Any, target: Any, reduction: str, ignore_index: int) -> Any:
    """Per-row losses to the reduction, as ``quack.cross_entropy.cross_entropy`` does it."""
    if reduction == "mean":
        return loss.sum() / (target != ignore_index).sum().float()
    return loss.sum() if reduction == "sum" else loss


def _peer_rtol(dtype: str) -> float:
    return 2e-3 if dtype == "float16" else (1.6e-2 if dtype == "bfloat16" else 1e-4)


def _numpy_of(values: Any) -> list[np.ndarray]:
    """Results of any kind (torch on any device, numpy) as float64 numpy, losses flat."""
    out = []
    for v in values:
        v = v.double().cpu().numpy() if hasattr(v, "cpu") else np.asarray(v, np.float64)
        out.append(v.reshape(-1) if v.ndim == 0 else v)
    return out


def _ce_kwargs(case: Case) -> dict[str, Any]:
    o = dict(case.options)
    return dict(ignore_index=o.get("ignore_index", -100), reduction=o.get("reduction", "mean"),
                label_smoothing=o.get("label_smoothing", 0.0))


def _tvm_fusion_api(case: Case, sets: list[dict[str, Any]], suffix: str = "") -> list[Provider]:
    """``tf.bn_stats`` / ``tf.cross_entropy`` as a user calls them on ``sets`` (numpy
    arrays or torch tensors): whatever the call does besides the kernel (argument
    checks, dispatch, output allocation, the target check) counts. Cross entropy
    both with the default ``check_targets=True`` and with ``check_targets=False``."""
    from .api import bn_stats, cross_entropy

    holder: dict[str, Any] = {}

    def keep(key: str, out: Any, first: bool) -> None:
        if first:
            holder[key] = out

    name = "tvm_fusion" + API + (f" ({suffix})" if suffix else "")
    if case.op == "bn_stats":
        return [Provider(
            name, [lambda s=s, i=i: keep("bn", bn_stats(s["x"], layout=case.layout), i == 0) for i, s in enumerate(sets)],
            lambda: _numpy_of(holder["bn"]), rtol=1e-4, api=True,
        )]
    kwargs = _ce_kwargs(case)
    providers = []
    for check in (True, False):
        key = f"ce {check}"
        label = name if check else f"tvm_fusion{API} ({suffix + ', ' if suffix else ''}check_targets=False)"
        providers.append(Provider(
            label, [lambda s=s, i=i, key=key, check=check: keep(key, cross_entropy(
                s["logits"], s["target"], s.get("weight"), check_targets=check, **kwargs), i == 0)
                for i, s in enumerate(sets)],
            lambda key=key: _numpy_of([holder[key]]), rtol=1e-4, api=True,
        ))
    return providers


def _api_providers_gpu(case: Case, torch_sets: list[dict[str, Any]], peers: list[Provider]) -> list[Provider]:
    """The user's calls on torch CUDA tensors: ours, and each peer that has one. A peer's
    graph launches are already its user call (``F.cross_entropy``, the compiled function,
    Liger's autograd function); Quack's user call is its autograd ``cross_entropy``."""
    providers = _tvm_fusion_api(case, torch_sets)
    for peer in peers:
        if peer.name == "Quack":
            continue
        providers.append(dataclasses.replace(peer, name=peer.name + API, api=True))
    quack = _quack_forward(case, torch_sets[0])
    if quack is not None:
        try:
            from quack.cross_entropy import cross_entropy as quack_ce
        except Exception:  # noqa: BLE001
            return providers
        import inspect

        kwargs = _ce_kwargs(case)
        own_reduction = "reduction" in inspect.signature(quack_ce).parameters  # older releases: per-row only
        holder: dict[str, Any] = {}

        def quack_call(s, first):
            if own_reduction:
                loss = quack_ce(s["logits"], s["target"], ignore_index=kwargs["ignore_index"], reduction=kwargs["reduction"])
            else:
                loss = _reduced(quack_ce(s["logits"], s["target"], ignore_index=kwargs["ignore_index"]),
                                s["target"], kwargs["reduction"], kwargs["ignore_index"])
            if first:
                holder["quack"] = loss

        providers.append(Provider(
            "Quack" + API, [lambda s=s, i=i: quack_call(s, i == 0) for i, s in enumerate(torch_sets)],
            lambda: _numpy_of([holder["quack"]]), _peer_rtol(case.dtype), api=True, skip_note=quack[1],
        ))
    return providers


def _api_providers_cpu(case: Case, host: dict[str, np.ndarray], numpy_provider: Provider) -> list[Provider]:
    """The user's calls on the CPU: ours on numpy arrays and on torch CPU tensors, numpy's
    own code, and torch eager on the same tensors."""
    providers = _tvm_fusion_api(case, [host])
    providers.append(dataclasses.replace(numpy_provider, name="numpy" + API, api=True))
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return providers

    def as_torch(a: np.ndarray):
        if a.dtype.name == "bfloat16":  # numpy's bfloat16 is ml_dtypes': pass the bits
            return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16).clone()
        return torch.from_numpy(a).clone()  # torch's allocator aligns to 64 bytes

    tensors = {k: as_torch(v) for k, v in host.items()}
    providers += _tvm_fusion_api(case, [tensors], "torch")
    problem = case.problem
    holder: dict[str, Any] = {}
    if isinstance(problem, BNStatsProblem):
        view = tensors["x"].reshape(problem.shape)
        dims = (0,) if problem.channels_last else (0, 2)

        def eager():
            var, mean = torch.var_mean(view if view.dtype == torch.float32 else view.float(), dim=dims, correction=0)
            holder["eager"] = (mean, var)
    else:
        kwargs = _ce_kwargs(case)
        target = tensors["target"].long()

        def eager():
            holder["eager"] = F.cross_entropy(tensors["logits"], target, tensors.get("weight"), **kwargs)

    providers.append(Provider("torch eager" + API, [eager], lambda: _numpy_of(
        holder["eager"] if isinstance(holder["eager"], tuple) else [holder["eager"]]), _peer_rtol(case.dtype), api=True))
    return providers


# -- the run -------------------------------------------------------------------------
def rotated_sets(case: Case, on_gpu: bool) -> int:
    return copies_for(case.problem.bytes_moved) if on_gpu else 1


def wanted(providers: set[str] | None, name: str, api: bool = False) -> bool:
    """Whether ``--providers`` asks for ``name``: by its full name, the part before ':'
    (``tvm_fusion`` for every candidate) or before ' api' (a provider's api rows come
    with it); ``api`` alone asks for every api row."""
    if providers is None:
        return True
    base = name.split(API)[0].split(":")[0]
    return name in providers or base in providers or (api and ("api" in providers or base + API in providers))


def candidate_kernels(problem, target) -> list[tuple[str, Kernel]]:
    """Ours: every applicable candidate with its default knobs (``tvm_fusion:<name>``),
    and the dispatch pick (``tvm_fusion (default)``)."""
    choice = choose(problem, target)
    kernels = [(f"tvm_fusion:{cand.name}", build_kernel(problem, target, cand.name))
               for cand in registry.applicable(problem, target)]
    kernels.append(("tvm_fusion (default)", build_kernel(problem, target, choice.candidate, choice.knobs,
                                                       choice.source)))
    return kernels


def bench_case(case: Case, on_gpu: bool, gen: np.random.Generator, providers: set[str] | None, log,
               api: bool = True) -> list[Result]:
    """Check and time every provider on one case: the kernels (graph replay on the GPU)
    and, with ``api``, the user's calls back to back (``<provider> api`` rows)."""
    problem = case.problem
    target = targets.resolve("cuda" if on_gpu else "llvm")
    copies = rotated_sets(case, on_gpu)
    results: list[Result] = []
    bytes_moved = problem.bytes_moved

    if on_gpu:
        first = device_inputs(case)
        torch_sets = [first] + [{k: v.clone() for k, v in first.items()} for _ in range(copies - 1)]
        reference = [r.cpu().numpy() for r in torch_reference(case, first)]
        tvm_sets = torch_sets
    else:
        host = make_inputs(case, gen)
        reference = host_reference(case, host)
        tvm_sets = [host]

    def want(name: str) -> bool:
        return wanted(providers, name)

    ours = candidate_kernels(problem, target)
    plan: list[Provider] = []
    for name, kernel in ours:
        if want(name) or want("tvm_fusion"):
            plan.append(_tvm_provider(name, kernel, case, tvm_sets, on_gpu))
    calls: list[Provider] = []
    if on_gpu:
        if want("TVM DLight"):
            try:
                plan.append(_tvm_provider("TVM DLight", _dlight_kernel(case, target), case, tvm_sets, on_gpu))
            except Exception as err:  # noqa: BLE001
                results.append(Result(case, "TVM DLight", None, bytes_moved, "-", f"failed: {type(err).__name__}: {str(err)[:120]}"))
        peers: list[Provider] = []
        try:
            peers = _torch_providers(case, torch_sets)
        except Exception as err:  # noqa: BLE001
            results.append(Result(case, "torch", None, bytes_moved, "-", f"failed: {str(err)[:120]}"))
        plan.extend(p for p in peers if want(p.name))
        if api:
            calls = _api_providers_gpu(case, torch_sets, peers)
    else:
        numpy_provider = _numpy_provider(case, tvm_sets[0])
        plan.append(numpy_provider)
        if api:
            calls = _api_providers_cpu(case, tvm_sets[0], numpy_provider)
    plan.extend(p for p in calls if wanted(providers, p.name, api=True))

    for provider in plan:
        try:
            provider.launches[0]()
            if on_gpu:
                import torch

                torch.cuda.synchronize()
            got = provider.results()
            ok = True
            worst = 0.0
            for g, r, scale in zip(got, reference, error_scales(case, reference)):
                good, err = close(g, r, provider.rtol, scale)
                ok, worst = ok and good, max(worst, err)
            if not ok:
                results.append(Result(case, provider.name, None, bytes_moved, "-", f"wrong: worst rel err {worst:.3g}"))
                log(f"  {provider.name:<48} WRONG (worst rel err {worst:.3g})")
                continue
            if provider.api:
                ms, method = time_calls_gpu(provider.launches) if on_gpu else time_calls_cpu(provider.launches)
            elif on_gpu:
                ms, method = time_gpu(provider.launches, graphable=provider.graphable)
            else:
                ms, method = time_cpu(provider.launches[0])
            results.append(Result(case, provider.name, ms, bytes_moved, method, "ok"))
            log(f"  {provider.name:<48} {ms:9.4f} ms  {bytes_moved / ms / 1e6:8.1f} GB/s  ({method})")
        except Exception as err:  # noqa: BLE001 - report and go on with the others
            if on_gpu:
                import torch

                torch.cuda.synchronize()
            why = f"{type(err).__name__}: {str(err)[:160]}"
            if provider.skip_note:
                results.append(Result(case, provider.name, None, bytes_moved, "-", f"skipped: {provider.skip_note}; {why}"))
                log(f"  {provider.name:<48} SKIPPED ({provider.skip_note}) {why}")
                continue
            results.append(Result(case, provider.name, None, bytes_moved, "-", f"failed: {why}"))
            log(f"  {provider.name:<48} FAILED {why}")
    return results


def _numpy_provider(case: Case, host: dict[str, np.ndarray]) -> Provider:
    problem = case.problem
    holder: dict[str, Any] = {}
    if isinstance(problem, BNStatsProblem):
        x = host["x"]
        axes = (0,) if problem.channels_last else (0, 2)
        view = x.reshape(problem.shape)

        def run():
            holder["out"] = [view.mean(axis=axes), view.var(axis=axes)]
    else:
        logits, target = host["logits"], host["target"]

        def run():
            # numpy's log-sum-exp and the same loss: max, exp(x - max), sum, log, gather.
            row_max = logits.max(axis=1, keepdims=True)
            lse = np.log(np.exp(logits - row_max).sum(axis=1)) + row_max[:, 0]
            valid = target != problem.ignore_index
            picked = logits[np.arange(problem.batch), np.where(valid, target, 0)]
            holder["out"] = [np.asarray(np.where(valid, lse - picked, 0.0).sum() / valid.sum())]

    return Provider("numpy", [run], lambda: holder["out"], rtol=1e-4)


def is_api(provider: str) -> bool:
    """An api row: ``<provider> api`` or ``<provider> api (<variant>)``."""
    return provider.endswith(API) or API + " (" in provider


def summarize(results: list[Result], copy_gb_s: float, log) -> None:
    by_case: dict[Case, list[Result]] = {}
    for r in results:
        by_case.setdefault(r.case, []).append(r)
    header = f"{'case':<40} {'provider':<48} {'ms':>9} {'GB/s':>8} {'copy%':>6} {'vs best peer':>12}"
    log("\n" + header + "\n" + "-" * len(header))
    peer_names = PEERS + ("numpy",)
    for case, rows in by_case.items():
        # Kernel rows against the best peer kernel, api rows against the best peer call.
        best = {}
        for mode in (False, True):
            peers = [r.median_ms for r in rows if r.median_ms and is_api(r.provider) == mode
                     and r.provider.removesuffix(API) in peer_names]
            best[mode] = min(peers) if peers else None
        for r in rows:
            if r.median_ms is None:
                log(f"{case.label():<40} {r.provider:<48} {r.status}")
                continue
            best_peer = best[is_api(r.provider)]
            speedup = f"{best_peer / r.median_ms:11.2f}x" if best_peer else ""
            log(f"{case.label():<40} {r.provider:<48} {r.median_ms:9.4f} {r.gb_s:8.1f} "
                f"{100 * r.gb_s / copy_gb_s:5.1f}% {speedup}")


def append_csv(results: list[Result], path: str, hardware: str, copy_gb_s: float,
               with_copy_row: bool = False) -> None:
    """Append rows (one per result; the copy ceiling first when asked) to the CSV."""
    new = not os.path.exists(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    version = version_string()
    with open(path, "a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS, lineterminator="\n")  # the file is LF throughout
        if new:
            writer.writeheader()
        if with_copy_row:
            writer.writerow(dict(hardware=hardware, date=date, version=version, op="copy", shape="",
                                 dtype="", options="", provider="device copy", median_ms="",
                                 gb_s=f"{copy_gb_s:.1f}", frac_copy="1.000", method="", status="ok"))
        for r in results:
            writer.writerow(dict(
                hardware=hardware, date=date, version=version, op=r.case.op,
                shape="x".join(map(str, r.case.shape)), dtype=r.case.dtype,
                options=";".join(f"{k}={v}" for k, v in r.case.options), provider=r.provider,
                median_ms="" if r.median_ms is None else f"{r.median_ms:.5f}",
                gb_s="" if r.gb_s is None else f"{r.gb_s:.1f}",
                frac_copy="" if r.gb_s is None else f"{r.gb_s / copy_gb_s:.3f}",
                method=r.method, status=one_line(r.status),
            ))


def one_line(text: str) -> str:
    """``text`` as one CSV line: terminal colour codes dropped, line breaks and runs of
    blanks made one space (a peer's compiler error, Quack's CuTe DSL on V = 50257 on the
    H200, came as several coloured lines)."""
    return " ".join(re.sub(r"\x1b\[[0-9;]*m", "", text).split())


def plot(results: list[Result], folder: str, copy_gb_s: float, hardware: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for op in sorted({r.case.op for r in results}):
        rows = [r for r in results if r.case.op == op and r.gb_s and not is_api(r.provider)]  # kernels only
        if not rows:
            continue
        cases = list(dict.fromkeys(r.case for r in rows))
        providers = list(dict.fromkeys(r.provider for r in rows if not r.provider.startswith("tvm_fusion:")))
        fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(cases)), 4), dpi=80)
        width = 0.8 / max(len(providers), 1)
        for j, provider in enumerate(providers):
            values = [next((r.gb_s for r in rows if r.case == c and r.provider == provider), 0) for c in cases]
            ax.bar([i + j * width for i in range(len(cases))], values, width, label=provider)
        ax.axhline(copy_gb_s, color="black", linestyle="--", linewidth=1, label="device copy")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
        ax.set_xticklabels(["x".join(map(str, c.shape)) + f"\n{c.dtype}" for c in cases], fontsize=8)
        ax.set_ylabel("GB/s (bytes read once / time)")
        ax.set_title(f"{op} on {hardware}")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        slug = "".join(c if c.isalnum() else "_" for c in hardware.split(" x")[0]).strip("_").lower()
        path = os.path.join(folder, f"bench_{op}_{slug[:40]}.png")
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def default_cases(on_gpu: bool) -> list[Case]:
    """What ``tvm-fusion bench`` runs without ``--shapes``."""
    return GPU_CASES + GPU_EXTRA_CASES if on_gpu else CPU_CASES


def run(cases: list[Case] | None = None, device: str | None = None, csv_path: str | None = None,
        plots: str | None = None, providers: set[str] | None = None, log=print, api: bool = True) -> list[Result]:
    on_gpu = gpu_available() if device is None else device == "cuda"
    if on_gpu and not gpu_available():
        raise RuntimeError("bench: --device cuda asked for, but torch sees no CUDA GPU")
    cases = cases or default_cases(on_gpu)
    hardware = hardware_name(on_gpu)
    gen = np.random.default_rng()
    copy_gb_s = copy_bandwidth_gpu() if on_gpu else copy_bandwidth_cpu()
    log(f"{hardware}: device copy {copy_gb_s:.1f} GB/s (read + write); {version_string()}")
    results: list[Result] = []
    if on_gpu:
        empty_ms = empty_launch_gpu()
        log(f"empty kernel launch: {empty_ms * 1e3:.2f} us")
        results.append(Result(Case("empty_kernel", (1,), "float32"), "empty launch", empty_ms, 0, "graph", "ok"))
    if csv_path:  # rows go out case by case, so a run cut short keeps what it measured
        append_csv(results, csv_path, hardware, copy_gb_s, with_copy_row=True)
    for case in cases:
        log(f"{case.label()}: {case.problem.bytes_moved / 1e6:.1f} MB moved at least")
        rows = bench_case(case, on_gpu, gen, providers, log, api)
        results.extend(rows)
        if csv_path:
            append_csv(rows, csv_path, hardware, copy_gb_s)
    summarize([r for r in results if r.case.op != "empty_kernel"], copy_gb_s, log)
    if csv_path:
        log(f"appended {len(results) + 1} rows to {csv_path}")
    unmatched = sorted(p for p in providers or () if not any(wanted({p}, r.provider, api=True) for r in results))
    if unmatched:  # a misspelt name ran nothing of its own, silently
        raise ValueError(f"bench: no provider matched {', '.join(map(repr, unmatched))}; the names this run had: "
                         f"{', '.join(sorted({r.provider.split(':')[0] for r in results}))}")
    if plots:
        os.makedirs(plots, exist_ok=True)
        for path in plot([r for r in results if r.case.op != "empty_kernel"], plots, copy_gb_s, hardware):
            log(f"wrote {path}")
    return results


# -- tuner against exhaustive timing -------------------------------------------------
def candidate_records(problem, target, log_dir) -> dict[str, Any]:
    """The best tuning record of each candidate for ``problem``: name -> (knobs, scheduled mod)."""
    from .dispatch import records_of

    best: dict[str, Any] = {}
    for found in sorted(records_of(problem, target, log_dir), key=lambda f: f.seconds):
        best.setdefault(found.candidate, (found.knobs, found.mod))
    return best


def compare_tuning(cases: list[Case], log_dir: str, tune_seconds: dict[str, float], csv_path: str | None,
                   log=print) -> list[Result]:
    """Time, on the GPU, every candidate with its default knobs and with its best tuned
    knobs, the untuned default pick and the tuner's pick; report the pick against the
    exhaustive best."""
    from .dispatch import best_record

    target = targets.resolve("cuda")
    hardware, copy_gb_s = hardware_name(True), copy_bandwidth_gpu()
    out: list[Result] = []
    for case in cases:
        problem = case.problem
        torch_sets = [device_inputs(case)]
        torch_sets += [{k: v.clone() for k, v in torch_sets[0].items()} for _ in range(rotated_sets(case, True) - 1)]
        timed: dict[str, float] = {}

        def measure(label: str, kernel: Kernel) -> None:
            provider = _tvm_provider(label, kernel, case, torch_sets, True)
            timed[label], _ = time_gpu(provider.launches)

        for cand in registry.applicable(problem, target):
            measure(f"default knobs: {cand.name}", build_kernel(problem, target, cand.name))
        for name, (knobs, mod) in candidate_records(problem, target, log_dir).items():
            measure(f"tuned: {name} [{knobs}]", build_kernel(problem, target, name, knobs, "record", mod=mod))
        default = registry.default_candidate(problem, target)
        untuned = timed[f"default knobs: {default.name}"]
        found = best_record(problem, target, log_dir)
        if found is None or (found.candidate, found.knobs) == (default.name, default.default_for(problem, target)):
            pick_label = f"default knobs: {default.name}"  # the same kernel: timed once
        else:
            pick_label = f"tuned: {found.candidate} [{found.knobs}]"
            if pick_label not in timed:
                measure(pick_label, build_kernel(problem, target, found.candidate, found.knobs, "record", mod=found.mod))
        pick, best_label = timed[pick_label], min(timed, key=timed.get)
        seconds = tune_seconds.get(problem.key(), float("nan"))
        note = (f"tuned in {seconds:.0f} s; pick/exhaustive best = {pick / timed[best_label]:.3f}; "
                f"pick/untuned default = {pick / untuned:.3f}")
        rows = [
            Result(case, f"tuner pick ({pick_label})", pick, problem.bytes_moved, "graph", f"ok; {note}"),
            Result(case, f"exhaustive best ({best_label})", timed[best_label], problem.bytes_moved, "graph", "ok"),
            Result(case, f"untuned default pick ({default.name})", untuned, problem.bytes_moved, "graph", "ok"),
        ]
        log(f"{case.label()}: pick {pick:.4f} ms ({pick_label}), exhaustive best {timed[best_label]:.4f} ms "
            f"({best_label}), untuned default {untuned:.4f} ms; {note}")
        out.extend(rows)
        if csv_path:
            append_csv(rows, csv_path, hardware, copy_gb_s)
    return out
