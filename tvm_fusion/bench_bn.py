"""BatchNorm in training on the GPU or the CPU: the forward, forward + backward, and a ResNet step.

Three ops go to the bench CSV:

- ``batch_norm_fwd``: ``F.batch_norm`` in training (affine, running statistics
  updated), floor 2x the input bytes (read x, write y) at the measured copy
  bandwidth;
- ``batch_norm_fwd_bwd``: that forward then ``torch.autograd.grad`` of ``y`` for
  ``x``, ``weight`` and ``bias``, floor 5x the input bytes (x read and y written;
  x and dy read and dx written);
- ``resnet_train_step``: one SGD step (forward, loss, backward, update) of the
  small ResNet of ``tvm_fusion.relax.model`` at ImageNet-like widths, torch's
  modules against ``tvm_fusion.torch.patch``'s, eager and under ``torch.compile``.

Providers: ``tvm_fusion.torch`` (the call a user makes), torch eager (cuDNN's
BatchNorm), ``torch.compile`` of the same function, issued back to back and timed
with CUDA events (``timing.time_calls_gpu``: host work counts); and beside them each
applicable candidate's kernels alone under CUDA-graph replay (``tvm_fusion:<name>``,
the forward, and for fwd_bwd the forward then dispatch's backward). Every provider's
outputs are checked against float64 torch first.

On the CPU (``run(device="cpu")``) the same ops over ``CPU_SHAPES`` and the step at
``CPU_RESNET``'s batch, timed with ``time.perf_counter``
(:class:`~tvm_fusion.timing.DeviceTiming`): the calls back to back, each CPU
candidate's kernels one call at a time, the floors at numpy's copy bandwidth. The peer
is torch eager (ATen's CPU BatchNorm) alone: ``providers`` says why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .bench import Case, Result, append_csv, hardware_name
from .contracts.common import DTYPE_BYTES
from .timing import DeviceTiming

FORWARD, TRAIN, STEP = "batch_norm_fwd", "batch_norm_fwd_bwd", "resnet_train_step"
# The anchors' shapes: ResNet stages in fp16 NCHW, and one in bf16 channels-last.
SHAPES = [
    ((64, 256, 56, 56), "float16", "NCHW"),
    ((32, 64, 112, 112), "float16", "NCHW"),
    ((256, 2048, 7, 7), "float16", "NCHW"),
    ((64, 256, 56, 56), "bfloat16", "channels_last"),
]
# The CPU's, float32, 26 MB of input each (the forward moves 2x that, forward +
# backward 5x: past a 32 MiB last-level cache): ResNet stage 1 at batch 32 in NCHW and channels-last, and
# stage 3 (wide channels, small planes) at batch 128.
CPU_SHAPES = [
    ((32, 64, 56, 56), "float32", "NCHW"),
    ((128, 256, 14, 14), "float32", "NCHW"),
    ((32, 64, 56, 56), "float32", "channels_last"),
]
FLOOR = {FORWARD: (2, "floor: read x + write y"), TRAIN: (5, "floor: 3 reads + 2 writes of x's size")}


@dataclasses.dataclass
class Inputs:
    x: Any
    weight: Any
    bias: Any
    running_mean: Any
    running_var: Any
    dy: Any


def make_inputs(shape, dtype: str, layout: str, gen) -> Inputs:
    import torch

    c, device = shape[1], gen.device
    x = (torch.randn(shape, device=device, generator=gen) * 2 + 0.5).to(getattr(torch, dtype))
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    dy = torch.randn(shape, device=device, generator=gen).to(x.dtype).to(memory_format=_format(layout))
    vec = lambda: torch.randn(c, device=device, generator=gen)  # noqa: E731
    return Inputs(x, vec() + 1, vec(), vec(), torch.rand(c, device=device, generator=gen) + 0.5, dy)


def _format(layout: str):
    import torch

    return torch.channels_last if layout == "channels_last" else torch.contiguous_format


def providers(op: str, device: str = "cuda") -> list[tuple[str, Callable[[Inputs], tuple]]]:
    """(name, run) on ``device``'s tensors: ``run(inputs)`` returns (y,) for the
    forward, (dx, dweight, dbias) for fwd_bwd; the running statistics are updated in place."""
    import torch
    import torch.nn.functional as F

    from . import torch as tft

    def forward(bn):
        def run(t):
            return (bn(t.x, t.running_mean, t.running_var, t.weight, t.bias, True, 0.1, 1e-5),)
        return run

    def train(bn):
        def run(t):
            x, w, b = (v.detach().requires_grad_() for v in (t.x, t.weight, t.bias))
            y = bn(x, t.running_mean, t.running_var, w, b, True, 0.1, 1e-5)
            return torch.autograd.grad(y, (x, w, b), t.dy)
        return run

    wrap = forward if op == FORWARD else train
    steps = [("tvm_fusion.torch", wrap(tft.batch_norm)), ("torch eager", wrap(F.batch_norm))]
    if device != "cuda":
        # No torch.compile on the CPU: inductor compiles C++ for each case afresh (the
        # reset below), compile time a small CPU host would spend instead of timing.
        return steps
    # Each case compiles afresh: dynamo caches per code object, so F.batch_norm's
    # compiles for the cases before (shapes, dtypes, layouts, the forward and the
    # training step) would count against its recompile limit, past which torch.compile
    # runs the function eagerly (the H200 bench at 0538344 timed eager under that name).
    torch.compiler.reset()
    return steps + [("torch.compile", wrap(torch.compile(F.batch_norm)))]


def check(op: str, outs: tuple, t: Inputs) -> str | None:
    """None when the outputs match float64 torch on the same inputs, else what is off."""
    import torch
    import torch.nn.functional as F

    x, w, b = (v.detach().double().requires_grad_() for v in (t.x, t.weight, t.bias))
    y = F.batch_norm(x, None, None, w, b, True, 0.1, 1e-5)
    refs = (y,) if op == FORWARD else torch.autograd.grad(y, (x, w, b), t.dy.double())
    for name, got, ref in zip(("y",) if op == FORWARD else ("dx", "dweight", "dbias"), outs, refs):
        scale = float(ref.abs().max()) or 1.0
        err = float((got.double() - ref).abs().max())
        if not err <= 2e-2 * scale:
            return f"wrong: {name} off by {err:.3g} (largest {scale:.3g})"
    return None


def kernel_launches(op: str, shape, dtype: str, layout: str,
                    device: str = "cuda") -> list[tuple[str, Callable[[Inputs], Callable]]]:
    """(name, make): ``make(inputs)`` returns a launch of the kernels alone (the
    forward candidate's, and for fwd_bwd then dispatch's backward) for ``device``'s
    target, and its outputs."""
    import torch

    from . import targets
    from .api import make_problem
    from .bench import candidate_kernels
    from .dispatch import kernel_for

    target = targets.for_device(device)
    kernel_layout = "NHWC" if layout == "channels_last" else "NCHW"
    kernel_shape = (shape[0], shape[2], shape[3], shape[1]) if layout == "channels_last" else shape
    forward_problem = make_problem("bn_forward", kernel_shape, dtype, layout=kernel_layout)
    backward = kernel_for(make_problem("bn_backward", kernel_shape, dtype, layout=kernel_layout), target)

    def as_kernel(v, problem_shape):
        return (v.permute(0, 2, 3, 1) if layout == "channels_last" else v).reshape(problem_shape)

    def maker(kernel):
        def make(t: Inputs):
            x = as_kernel(t.x, forward_problem.shape)
            outs = [torch.empty(s, dtype=getattr(torch, d), device=device) for _, s, d in kernel.outputs]
            momentum = torch.full((), 0.1, device=device)
            args = [x, t.weight, t.bias, t.running_mean.clone(), t.running_var.clone(), momentum]
            if op == FORWARD:
                return lambda: kernel.func(*args, *outs), (outs[0],)
            dy = as_kernel(t.dy, forward_problem.shape)
            grads = [torch.empty(s, dtype=getattr(torch, d), device=device) for _, s, d in backward.outputs]

            def launch():
                kernel.func(*args, *outs)
                backward.func(x, dy, outs[1], outs[2], t.weight, *grads)

            return launch, tuple(grads)
        return make

    return [(name, maker(kernel)) for name, kernel in candidate_kernels(forward_problem, target)]


def _back_to_input(op, outs, t: Inputs, layout):
    """Kernel outputs (canonical views) in the input's shape, for the check."""
    first = outs[0]
    if layout == "channels_last":
        n, c, h, w = t.x.shape
        first = first.view(n, h, w, c).permute(0, 3, 1, 2)
    else:
        first = first.view(t.x.shape)
    return (first, *outs[1:])


def bench_ops(log=print, copy_gb_s: float | None = None, device: str = "cuda",
              shapes: list[tuple] | None = None) -> list[Result]:
    """The forward and fwd_bwd rows of each (shape, dtype, layout) on ``device``
    (default: that device's list)."""
    import torch

    timing = DeviceTiming(device)
    copy_gb_s = copy_gb_s or timing.copy_bandwidth()
    results = []
    for shape, dtype, layout in shapes or (SHAPES if timing.on_gpu else CPU_SHAPES):
        gen = torch.Generator(device=device).manual_seed(0)
        first = make_inputs(shape, dtype, layout, gen)
        input_bytes = first.x.numel() * DTYPE_BYTES[dtype]
        sets = [first] + [make_inputs(shape, dtype, layout, gen)
                          for _ in range(timing.input_sets(3 * input_bytes) - 1)]
        options = (("layout", layout),) if layout != "NCHW" else ()
        for op in (FORWARD, TRAIN):
            case = Case(op, shape, dtype, options)
            factor, floor_name = FLOOR[op]
            nbytes = factor * input_bytes
            log(f"{case.label()}: floor {nbytes / copy_gb_s / 1e6:.4f} ms")
            rows = [Result(case, floor_name, nbytes / copy_gb_s / 1e6, nbytes, "copy bandwidth", "ok")]
            for name, make in kernel_launches(op, shape, dtype, layout, device):
                rows.append(_timed(case, name, nbytes, copy_gb_s, log, timing, lambda make=make: _kernel_row(
                    op, make, sets, layout, timing)))
            for name, run in providers(op, device):
                rows.append(_timed(case, name, nbytes, copy_gb_s, log, timing,
                                   lambda run=run: _call_row(op, run, sets, timing)))
            results.extend(rows)
        del sets, first
        timing.release()
    return results


def _kernel_row(op, make, sets, layout, timing: DeviceTiming):
    launch, outs = make(sets[0])
    launch()
    wrong = check(op, _back_to_input(op, outs, sets[0], layout), sets[0])
    if wrong:
        return None, wrong, "-"
    ms, method = timing.kernels([make(t)[0] for t in sets])
    return ms, "ok", method


def _call_row(op, run, sets, timing: DeviceTiming):
    wrong = check(op, run(sets[0]), sets[0])
    if wrong:
        return None, wrong, "-"
    ms, method = timing.calls([lambda t=t: run(t) for t in sets])
    return ms, "ok", method


def _timed(case, name, nbytes, copy_gb_s, log, timing: DeviceTiming, measure) -> Result:
    try:
        ms, status, method = measure()
    except Exception as err:  # noqa: BLE001 - report and go on with the others
        timing.synchronize()
        ms, status, method = None, f"failed: {type(err).__name__}: {str(err)[:160]}", "-"
    if ms is None:
        log(f"  {name:<44} {status}")
    else:
        log(f"  {name:<44} {ms:9.4f} ms  {nbytes / ms / 1e6:8.1f} GB/s  {nbytes / ms / 1e6 / copy_gb_s:6.1%} of copy")
    return Result(case, name, ms, nbytes, method, status)


# -- a whole training step ------------------------------------------------------------------
RESNET = {"width": 64, "num_classes": 1000, "batch": 64, "image": 56}
# The CPU's: the same model at batch 8, about 8.6 GFLOP a step (1.07 GFLOP an image
# forward and backward, nearly all of it the two 64-to-64-channel 3x3 convolutions on
# 56x56), against the GPU's 69.
CPU_RESNET = {**RESNET, "batch": 8}


def bench_step(log=print, device: str = "cuda", resnet: dict[str, int] | None = None) -> list[Result]:
    """Median ms of an SGD step of the small ResNet (fp32 weights, bf16 autocast off:
    the model as written), torch's modules against patched ones, eager and compiled
    (eager alone on the CPU: ``providers`` says why); ``resnet`` as ``RESNET``."""
    import copy

    import torch

    from . import torch as tft
    from .relax.model import example_inputs, small_resnet

    timing = DeviceTiming(device)
    resnet = resnet or (RESNET if timing.on_gpu else CPU_RESNET)
    torch.manual_seed(0)
    base = small_resnet(resnet["width"], resnet["num_classes"]).to(device)
    x, target = (t.to(device) for t in example_inputs(resnet["batch"], resnet["image"], resnet["num_classes"]))
    case = Case(STEP, (resnet["batch"], 3, resnet["image"], resnet["image"]), "float32",
                (("width", resnet["width"]),))
    variants = []
    for patched in (False, True):
        for compiled in (False, True) if timing.on_gpu else (False,):
            model = copy.deepcopy(base)
            if patched:
                tft.patch(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            forward = torch.compile(model) if compiled else model
            name = ("tvm_fusion.torch patch" if patched else "torch eager") + (" + torch.compile" if compiled else "")
            if not patched and compiled:
                name = "torch.compile"
            variants.append((name, forward, opt))
    rows = []
    for name, forward, opt in variants:
        def step(forward=forward, opt=opt):
            opt.zero_grad(set_to_none=True)
            _, loss = forward(x, target)
            loss.backward()
            opt.step()
            return loss

        try:
            ms, method = timing.calls([step])
            rows.append(Result(case, name, ms, 0, method + " (SGD step)", "ok"))
            log(f"  {case.label()} {name:<40} {ms:9.4f} ms")
        except Exception as err:  # noqa: BLE001
            rows.append(Result(case, name, None, 0, "-", f"failed: {type(err).__name__}: {str(err)[:160]}"))
            log(f"  {case.label()} {name:<40} failed: {err}")
    return rows


def run(csv_path: str | None = None, log=print, copy_gb_s: float | None = None, step: bool = True,
        device: str = "cuda", shapes: list[tuple] | None = None, resnet: dict[str, int] | None = None) -> list[Result]:
    """Every row on ``device`` ("cuda" or "cpu"); ``shapes`` and ``resnet`` default to that device's."""
    timing = DeviceTiming(device)
    copy_gb_s = copy_gb_s or timing.copy_bandwidth()
    results = bench_ops(log, copy_gb_s, device, shapes)
    if step:
        results += bench_step(log, device, resnet)
    if csv_path:
        append_csv(results, csv_path, hardware_name(timing.on_gpu), copy_gb_s)
    return results
