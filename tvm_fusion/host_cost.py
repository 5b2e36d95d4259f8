"""Where a public call's host time goes: each step of the hot path timed alone.

``python -m tvm_fusion.host_cost`` times, in microseconds of host time per call
(a loop of back-to-back calls with ``time.perf_counter``, the GPU never waited on
inside the loop), the steps a call of ``tf.bn_stats`` and ``tf.cross_entropy``
takes on torch tensors: an output allocation, the signature, the launch counter,
a TVM function call with one and with six tensor arguments of an empty kernel,
each call's compiled kernel called directly on prepared arguments, and the whole
call, next to torch's own launch and call. When the call is longer than its
kernel it is host-bound, and the table says which step to cut. ``--train`` times
instead a training step's parts through ``tvm_fusion.torch`` against torch eager's
(cross entropy, a BatchNorm2d module), and ``--csv`` appends those figures to the
benchmark CSV.

This times the host only; ``tvm-fusion bench`` (api rows) times what the caller
sees, which is the longer of host and kernel.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

REPEATS = 9
CALLS = 200  # per timed loop: far below a CUDA launch queue's depth, so the loop never blocks


def host_us(call: Callable[[], Any], sync: Callable[[], None], calls: int | None = None,
            repeats: int | None = None) -> float:
    """Median host microseconds per ``call`` over ``repeats`` loops of ``calls``
    (default REPEATS and CALLS; ``sync`` waits for the device between loops, never
    inside one)."""
    calls, repeats = calls or CALLS, repeats or REPEATS
    for _ in range(min(calls, 10)):
        call()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) * 1e6 / calls)
        sync()
    return statistics.median(times)


def _empty_kernels(device: str):
    """Two compiled functions of one launch each that write one float: with one
    tensor parameter, and with six (the others unused), to price tvm-ffi's tensor
    arguments against the launch."""
    import tvm
    from tvm import s_tir, te

    from . import targets

    target = targets.for_device(device)
    built = []
    for inputs in (0, 5):
        srcs = [te.placeholder((1,), "float32", f"in{k}") for k in range(inputs)]
        out = te.compute((1,), lambda i: sum((s[i] for s in srcs), tvm.tirx.const(1.0, "float32")), "out")
        sch = s_tir.Schedule(te.create_prim_func([out, *srcs]))
        if device == "cuda":
            (loop,) = sch.get_loops(sch.get_sblock("out"))
            sch.bind(loop, "threadIdx.x")
        with target:
            built.append(tvm.compile(sch.mod, target=target)["main"])
    return built


def _prepared(kernel: Any, inputs: list[Any], device: Any) -> list[Any]:
    """``kernel.packed``'s arguments: ``inputs``, fresh torch outputs, its workspace,
    and a zeroed launch counter if the kernel takes one."""
    import torch

    from . import single_launch

    outs = [torch.empty(shape, dtype=getattr(torch, dtype), device=device) for _, shape, dtype in kernel.outputs]
    workspace = [torch.empty(shape, dtype=getattr(torch, dtype), device=device) for _, shape, dtype in kernel.workspace]
    counter = [single_launch.zeroed_counter(device)] if kernel.counted else []
    return [*inputs, *outs, *workspace, *counter]


def breakdown(device: str = "cuda") -> dict[str, float]:
    """Host microseconds per call of each step, keyed by a short description."""
    import torch
    import torch.nn.functional as F

    import tvm_fusion as tf

    from . import api, arrays, targets
    from .contracts import bn_stats_problem, cross_entropy_problem
    from .dispatch import kernel_for

    cuda = device == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gen = torch.Generator(device=dev).manual_seed(0)
    out: dict[str, float] = {}

    def put(name: str, call: Callable[[], Any]) -> None:
        out[name] = host_us(call, sync)

    put("torch.empty(3) float32", lambda: torch.empty(3, dtype=torch.float32, device=dev))
    put("torch.empty(()) float32", lambda: torch.empty((), dtype=torch.float32, device=dev))
    put("two torch.empty(3) float32", lambda: (torch.empty(3, dtype=torch.float32, device=dev),
                                               torch.empty(3, dtype=torch.float32, device=dev)))
    put("torch.empty(8).split_with_sizes([3, 1, 3, 1])",
        lambda: torch.empty(8, dtype=torch.float32, device=dev).split_with_sizes([3, 1, 3, 1]))
    put("torch.empty(2, 4).unbind(0)", lambda: torch.empty(2, 4, dtype=torch.float32, device=dev).unbind(0))
    tiny = torch.zeros(1, device=dev)
    put("torch launch: tiny.zero_()", tiny.zero_)
    x = torch.randn(8, 3, 224, 224, device=dev, generator=gen).half()
    put("arrays.signature(x)", lambda: arrays.signature(x))
    if cuda:
        put("launch counter lookup", arrays.Kind(arrays.inspect(x, "host_cost", "x")).scratch([], counter=True))
        put("torch.cuda.is_current_stream_capturing()", torch.cuda.is_current_stream_capturing)
        put("torch._C._cuda_isCurrentStreamCapturing()", torch._C._cuda_isCurrentStreamCapturing)

    one, six = _empty_kernels(device)
    args = [torch.zeros(1, device=dev) for _ in range(6)]
    put("TVM call, empty kernel, 1 torch tensor", lambda: one(args[0]))
    put("TVM call, empty kernel, 6 torch tensors", lambda: six(*args))
    tvm_args = [arrays.to_tvm(arrays.inspect(a, "host_cost", "a")) for a in args]
    put("TVM call, empty kernel, 6 TVM tensors", lambda: six(*tvm_args))

    # bn_stats 8x3x224x224 fp16: the kernel on prepared arguments, then the call.
    target = targets.for_device(device)
    kernel = kernel_for(bn_stats_problem(tuple(x.shape), "float16", "NCHW"), target)
    bn_args = _prepared(kernel, [x.view(*kernel.params[0][1])], dev)
    put(f"bn_stats 8x3x224x224 fp16: kernel on prepared args ({kernel.candidate})", lambda: kernel.packed(*bn_args))
    put("bn_stats 8x3x224x224 fp16: tf.bn_stats(x)", lambda: tf.bn_stats(x))
    if cuda:
        put("bn_stats 8x3x224x224 fp16: torch.batch_norm_stats(x, 1e-5)", lambda: torch.batch_norm_stats(x, 1e-5))

    # cross_entropy 128x32000 fp16 mean.
    logits = torch.randn(128, 32000, device=dev, generator=gen).half()
    target_idx = torch.randint(0, 32000, (128,), device=dev, generator=gen)
    problem = cross_entropy_problem((128, 32000), "float16", (128,), "int64", None, "float32", -100, "mean", 0.0)
    kernel = kernel_for(problem, target)
    ce_args = _prepared(kernel, [logits, target_idx], dev)
    put(f"cross_entropy 128x32000 fp16: kernel on prepared args ({kernel.candidate})", lambda: kernel.packed(*ce_args))
    put("cross_entropy 128x32000 fp16: tf.cross_entropy(check_targets=False)",
        lambda: tf.cross_entropy(logits, target_idx, check_targets=False))
    put("cross_entropy 128x32000 fp16: tf.cross_entropy (default check)", lambda: tf.cross_entropy(logits, target_idx))
    put("cross_entropy 128x32000 fp16: F.cross_entropy", lambda: F.cross_entropy(logits, target_idx))
    api.check_targets()

    # The launchers themselves, taken apart: the launch replaced by a no-op (what is
    # left is Python and the output allocations), then the allocators too.
    x_call = lambda: tf.bn_stats(x)  # noqa: E731
    ce_call = lambda: tf.cross_entropy(logits, target_idx, check_targets=False)  # noqa: E731
    for name, call, launcher in (
        ("bn_stats 8x3x224x224 fp16", x_call, api._LAUNCHERS[("bn_stats", arrays.signature(x), "NCHW")]),
        ("cross_entropy 128x32000 fp16 (check_targets=False)", ce_call, api._LAUNCHERS[(
            "cross_entropy", api.ce_key(logits, target_idx, None, -100, "mean", 0.0, False))]),
    ):
        cells = dict(zip(launcher.__code__.co_freevars, launcher.__closure__ or ()))
        saved = {k: c.cell_contents for k, c in cells.items()}
        try:
            cells["func"].cell_contents = lambda *a: None
            put(f"{name}: call, launch a no-op", call)
            for alloc in ("empty", "new_loss"):
                if alloc in cells:
                    made = saved[alloc]()
                    cells[alloc].cell_contents = lambda made=made: made
            put(f"{name}: call, launch a no-op, outputs preallocated", call)
            if "scratch" in cells:
                tail = saved["scratch"]()
                cells["scratch"].cell_contents = lambda tail=tail: tail
                put(f"{name}: call, launch a no-op, outputs and scratch preallocated", call)
        finally:
            for k, c in cells.items():
                c.cell_contents = saved[k]
    if cuda:
        template = torch.empty(1, device=dev)
        for label, make in (
            ("torch.empty([])", lambda: torch.empty([], dtype=torch.float32, device=dev)),
            ("torch.empty(size=())", lambda: torch.empty(size=(), dtype=torch.float32, device=dev)),
            ("torch.empty_strided((), ())", lambda: torch.empty_strided((), (), dtype=torch.float32, device=dev)),
            ("template.new_empty(())", lambda: template.new_empty(())),
            ("torch.empty(1)", lambda: torch.empty(1, dtype=torch.float32, device=dev)),
            ("x.view(8, 3, 50176)", lambda: x.view(8, 3, 50176)),
            ("x.device", lambda: x.device),
            ("x.get_device()", x.get_device),
            ("ce_key", lambda: api.ce_key(logits, target_idx, None, -100, "mean", 0.0, False)),
        ):
            put(label, make)
    return out


def single_launch_ab(rounds: int = 3) -> dict[str, float]:
    """The merged (one launch) and the two-launch build of each call's kernel for
    bn_stats 8x3x224x224 and cross_entropy 128x32000 fp16, timed alternately in one
    process: kernel ms under CUDA-graph replay and host us of a direct call, the
    median over ``rounds`` rounds (the host's speed drifts between processes by as
    much as a launch costs)."""
    import torch

    from . import single_launch, targets, timing
    from .kernel import build_kernel
    from .contracts import bn_stats_problem, cross_entropy_problem
    from .dispatch import choose

    dev, target = torch.device("cuda", 0), targets.for_device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(8, 3, 50176, device=dev, generator=gen).half()
    logits = torch.randn(128, 32000, device=dev, generator=gen).half()
    target_idx = torch.randint(0, 32000, (128,), device=dev, generator=gen)
    problems = {
        "bn_stats 8x3x224x224 fp16": (bn_stats_problem((8, 3, 224, 224), "float16", "NCHW"), [x]),
        "cross_entropy 128x32000 fp16": (cross_entropy_problem(
            (128, 32000), "float16", (128,), "int64", None, "float32", -100, "mean", 0.0), [logits, target_idx]),
    }
    launches: dict[str, Callable[[], Any]] = {}
    enabled = single_launch.ENABLED
    try:
        for merged in (True, False):
            single_launch.ENABLED = merged
            for name, (problem, inputs) in problems.items():
                choice = choose(problem, target)
                kernel = build_kernel(problem, target, choice.candidate, choice.knobs, mod=choice.mod)
                args = _prepared(kernel, inputs, dev)
                launches[f"{name}, {kernel.launches()} launch(es)"] = (lambda k=kernel, a=args: k.packed(*a))
    finally:
        single_launch.ENABLED = enabled
    samples: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, launch in launches.items():
            samples.setdefault(f"{name}: kernel ms (graph)", []).append(timing.time_gpu([launch])[0])
            samples.setdefault(f"{name}: host us (direct call)", []).append(host_us(launch, torch.cuda.synchronize))
    return {name: statistics.median(values) for name, values in samples.items()}


# A training step's parts, at shapes whose kernels are shorter than the host's work:
# (cross entropy logits, dtype, BatchNorm2d input, dtype) on each device.
TRAIN_SHAPES = {"cuda": ((128, 32000), "float16", (8, 64, 28, 28), "float16"),
                "cpu": ((8, 64), "float32", (4, 8, 5, 5), "float32")}
TRAIN_ROUNDS = 9


def training_steps(device: str = "cuda", rounds: int = TRAIN_ROUNDS) -> list[tuple[str, tuple, str, str, str, float]]:
    """Host microseconds per call of a training step's parts, ours (``tvm_fusion.torch``)
    and torch eager's, in rows ``(part, shape, dtype, options, provider, us)``: cross
    entropy's forward with the logits needing a gradient and its forward + backward,
    a ``BatchNorm2d`` module's forward and its forward + backward, contiguous and
    channels-last. Each round times every call once (a loop of :data:`CALLS`), ours and
    torch's in turn, so a drift of the host's speed moves both; the figure is the
    median over ``rounds`` rounds. On the CPU the kernels run inside the call, so the
    shapes there are tiny (:data:`TRAIN_SHAPES`)."""
    import torch
    import torch.nn.functional as F

    import tvm_fusion as tf
    import tvm_fusion.torch as tft

    cuda = device == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    (batch, classes), ce_dtype, bn_shape, bn_dtype = TRAIN_SHAPES["cuda" if cuda else "cpu"]
    gen = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(batch, classes, device=dev, generator=gen).to(getattr(torch, ce_dtype)).requires_grad_()
    target = torch.randint(0, classes, (batch,), device=dev, generator=gen)
    channels, dt = bn_shape[1], getattr(torch, bn_dtype)
    ours_bn, torch_bn = tft.BatchNorm2d(channels).to(dev), torch.nn.BatchNorm2d(channels).to(dev)
    x, xc = (torch.randn(bn_shape, device=dev, generator=gen).to(dt).to(memory_format=fmt).requires_grad_()
             for fmt in (torch.contiguous_format, torch.channels_last))
    dy = torch.randn(bn_shape, device=dev, generator=gen).to(dt)
    ce_shape, bn = (batch, classes), bn_shape
    parts = [
        ("cross_entropy forward", ce_shape, ce_dtype, "",
         lambda: tft.cross_entropy(logits, target), lambda: F.cross_entropy(logits, target)),
        ("cross_entropy forward+backward", ce_shape, ce_dtype, "",
         lambda: tft.cross_entropy(logits, target).backward(), lambda: F.cross_entropy(logits, target).backward()),
        ("BatchNorm2d forward", bn, bn_dtype, "", lambda: ours_bn(x), lambda: torch_bn(x)),
        ("BatchNorm2d forward+backward", bn, bn_dtype, "",
         lambda: ours_bn(x).backward(dy), lambda: torch_bn(x).backward(dy)),
        ("BatchNorm2d forward+backward", bn, bn_dtype, "layout=channels_last",
         lambda: ours_bn(xc).backward(dy), lambda: torch_bn(xc).backward(dy)),
    ]
    samples: dict[tuple, list[float]] = {}
    for _ in range(rounds):
        for part, shape, dtype, options, ours, theirs in parts:
            for provider, call in (("tvm_fusion.torch", ours), ("torch eager", theirs)):
                samples.setdefault((part, shape, dtype, options, provider), []).append(host_us(call, sync, repeats=1))
    tf.check_targets()  # the deferred target checks of the timed calls
    return [(*key, statistics.median(values)) for key, values in samples.items()]


def append_training_rows(rows: list[tuple[str, tuple, str, str, str, float]], path: str, device: str,
                         rounds: int = TRAIN_ROUNDS) -> None:
    """``rows`` of :func:`training_steps` (over ``rounds`` rounds) appended to the
    benchmark CSV, one per part and provider."""
    from .bench import Case, Result, append_csv, hardware_name

    method = f"host perf_counter median of {rounds} interleaved loops of {CALLS} (host_cost --train)"
    results = [Result(Case(part.replace(" ", "_"), shape, dtype, (tuple(options.split("=", 1)),) if options else ()),
                      f"{provider}: host time", us / 1e3, 0, method, "ok")
               for part, shape, dtype, options, provider, us in rows]
    append_csv(results, path, hardware_name(device == "cuda"), copy_gb_s=float("nan"))


def environment() -> dict[str, Any]:
    import torch
    import tvm_ffi

    return {
        "torch": torch.__version__,
        "tvm_ffi": tvm_ffi.__version__,
        # tvm-ffi takes torch tensors through this C API when torch has it; else one
        # Python-level DLPack conversion per tensor.
        "torch_dlpack_c_exchange_api": hasattr(torch.Tensor, "__dlpack_c_exchange_api__"),
        "tvm_ffi_jit_addon": getattr(sys.modules.get("tvm_ffi._optional_torch_c_dlpack"), "_LIB", None) is not None,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tvm_fusion.host_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when torch sees a GPU")
    parser.add_argument("--ab", action="store_true",
                        help="also the merged against the two-launch kernels, interleaved (CUDA)")
    parser.add_argument("--train", action="store_true",
                        help="only a training step's parts, ours against torch eager's, interleaved")
    parser.add_argument("--csv", help="with --train: append the figures to this benchmark CSV")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.csv and not args.train:
        parser.error("--csv needs --train")
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    env = environment()
    if args.train:
        rows = training_steps(device, TRAIN_ROUNDS)
        if args.csv:
            append_training_rows(rows, args.csv, device, TRAIN_ROUNDS)
        figures = {" ".join(filter(None, (part, "x".join(map(str, shape)), dtype, options))) + f": {provider}": us
                   for part, shape, dtype, options, provider, us in rows}
    else:
        figures = breakdown(device)
    if args.ab and device == "cuda":
        figures.update(single_launch_ab())
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    width = max(map(len, figures))
    for name, us in figures.items():
        print(f"{name:<{width}}  {us:9.4f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"environment": env, "device": device, "host_us": figures}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
