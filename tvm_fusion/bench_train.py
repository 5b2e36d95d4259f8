"""Forward + backward of cross entropy, as a training step runs it, on the GPU or the CPU.

Each provider's step is what training code writes: ``loss = f(logits, target)``
then the gradient of the logits (``torch.autograd.grad``), issued back to back and
timed with CUDA events (``timing.time_calls_gpu``: host work counts whenever it
outlasts the kernels). Beside them, each fused gradient candidate's kernels alone
(``tvm_fusion:<candidate>`` and the default pick, CUDA-graph replay): the loss and
the gradient of the mean in one launch sequence, what a step costs the GPU. The floor is reading the logits once and writing their
gradient once at the measured copy bandwidth. Rows go to the bench CSV with op
``cross_entropy_fwd_bwd``; every provider's loss and gradient are first checked
against float64 torch (row blocks, so the largest shapes fit).

On the CPU (``run(device="cpu")``) the same rows over ``CPU_TRAIN_CASES``, timed with
``time.perf_counter`` (:class:`~tvm_fusion.timing.DeviceTiming`): the steps back to
back, each CPU candidate's kernel alone one call at a time, the floor at numpy's copy
bandwidth; the peers are torch eager alone (``providers`` says why).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

from .bench import Case, Result, append_csv, candidate_kernels, hardware_name
from .contracts.common import DTYPE_BYTES
from .timing import DeviceTiming

OP = "cross_entropy_fwd_bwd"
# The anchors' shapes (mean over valid rows, no weight, no smoothing).
TRAIN_CASES = [
    Case(OP, (4096, 32000), "float16"),
    Case(OP, (8192, 128256), "bfloat16"),
    Case(OP, (65536, 1000), "float16"),
    Case(OP, (16384, 50257), "bfloat16"),
    Case(OP, (128, 32000), "float16"),
]
# The CPU's: float32, 33-131 MB of logits. A Llama-2 vocabulary over 1024 rows,
# ImageNet's 1000 classes over 8192 rows (many short rows), GPT-2's odd vocabulary
# (50257: no vector width divides a row) over 256 rows.
CPU_TRAIN_CASES = [
    Case(OP, (1024, 32000), "float32"),
    Case(OP, (8192, 1000), "float32"),
    Case(OP, (256, 50257), "float32"),
]
FLOOR = "floor: read + write once"


def floor_bytes(case: Case) -> int:
    batch, classes = case.shape
    return 2 * batch * classes * DTYPE_BYTES[case.dtype] + 8 * batch


@dataclasses.dataclass
class Step:
    name: str
    run: Callable[[Any, Any], tuple[Any, Any]]  # (logits, target) -> (loss, dlogits)
    in_place: bool = False  # writes the gradient over the logits: needs its own copies


@functools.cache
def _layer_output():
    """An autograd Function standing for the layer that made the logits: its output is a
    non-leaf tensor on the input's memory (no copy, no kernel), its backward passes the
    gradient through. The in-place steps (``inplace_backward``, Liger, Quack) take their
    logits from it: a training step's logits come out of a layer, and
    ``tvm_fusion.torch`` refuses, as torch does for in-place writes, to overwrite a leaf
    that requires grad. The same for every in-place peer, so each pays its host cost. Made once."""
    import torch

    class LayerOutput(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return torch.empty(0, dtype=x.dtype, device=x.device).set_(
                x.untyped_storage(), x.storage_offset(), x.shape, x.stride())

        @staticmethod
        def backward(ctx, grad):
            return grad

    return LayerOutput


def providers(case: Case, device: str = "cuda") -> list[Step]:
    """The user's steps on ``device``'s tensors: ours (and its variants), then the peers."""
    import torch
    import torch.nn.functional as F

    from . import torch as tft

    layer_output = _layer_output()

    def autograd(loss_fn, non_leaf=False):
        def run(x, t):
            x = x.detach().requires_grad_()
            if non_leaf:  # the logits a layer made, not a leaf: an in-place loss may overwrite them
                x = layer_output.apply(x)
            loss = loss_fn(x, t)
            (grad,) = torch.autograd.grad(loss, x)
            return loss, grad
        return run

    steps = [
        Step("tvm_fusion.torch", autograd(tft.cross_entropy)),
        Step("tvm_fusion.torch (check_targets=False)", autograd(lambda x, t: tft.cross_entropy(x, t, check_targets=False))),
        Step("tvm_fusion.torch (inplace_backward)", autograd(lambda x, t: tft.cross_entropy(x, t, inplace_backward=True), True),
             in_place=True),
        Step("torch eager", autograd(F.cross_entropy)),
    ]
    if device != "cuda":
        # No torch.compile on the CPU: inductor compiles C++ for each case's forward and
        # backward afresh (the reset below), compile time a small CPU host would spend
        # instead of timing. Liger (Triton) and Quack (CuTe DSL) run on CUDA devices only.
        return steps
    torch.compiler.reset()  # a fresh compile per case: dynamo's recompile limit counts per code object
    steps.append(Step("torch.compile", autograd(torch.compile(F.cross_entropy))))
    try:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction

        def liger(x, t):
            loss = LigerCrossEntropyFunction.apply(x, t, None, -100, 0.0, 0.0, "mean")
            return loss[0] if isinstance(loss, tuple) else loss

        steps.append(Step("Liger (grad in forward)", autograd(liger, True), in_place=True))
    except ImportError:
        pass
    try:
        from quack.cross_entropy import cross_entropy as quack_ce

        params = inspect.signature(quack_ce).parameters
        mean = {"reduction": "mean"} if "reduction" in params else {}  # older releases: per-row losses

        def quack(x, t, **extra):
            loss = quack_ce(x, t, **mean, **extra)
            return loss if mean else loss.mean()

        if "inplace_backward" in params:
            steps.append(Step("Quack (dx in forward, in place)",
                              autograd(lambda x, t: quack(x, t, inplace_backward=True), True), in_place=True))
        else:
            steps.append(Step("Quack", autograd(quack)))
    except Exception:  # noqa: BLE001 - Quack is optional (and needs CuTe DSL)
        pass
    return steps


def kernel_steps(case: Case, device: str = "cuda") -> list[tuple[str, Any]]:
    """Every applicable fused gradient candidate with its default knobs, and dispatch's
    pick, for ``device``'s target: the kernels alone, beside the user's steps."""
    from . import targets
    from .api import make_problem

    return candidate_kernels(make_problem("cross_entropy_grad", case.shape, case.dtype, mode="fused"),
                             targets.for_device(device))


def _kernel_launch(kernel: Any, logits: Any, target: Any) -> tuple[Callable[[], None], Any, Any]:
    import torch

    outs = [torch.empty(shape, dtype=getattr(torch, dtype), device=logits.device) for _, shape, dtype in kernel.outputs]
    names = [name for name, _, _ in kernel.outputs]
    return (lambda: kernel.func(logits, target, *outs)), outs[names.index("loss")], outs[names.index("dlogits")]


def check(case: Case, loss: Any, grad: Any, logits: Any, target: Any) -> str | None:
    """None when ``loss`` and ``grad`` match float64 torch, else what is off."""
    import torch

    batch = logits.shape[0]
    ref_loss, worst, scale = 0.0, 0.0, 0.0
    for start in range(0, batch, 2048):
        x = logits[start : start + 2048].double()
        t = target[start : start + 2048]
        lse = torch.logsumexp(x, dim=1)
        ref_loss += float((lse - x.gather(1, t[:, None])[:, 0]).sum())
        ref = torch.softmax(x, dim=1)
        ref[torch.arange(x.shape[0], device=x.device), t] -= 1.0
        ref /= batch
        scale = max(scale, float(ref.abs().max()))
        worst = max(worst, float((grad[start : start + 2048].double() - ref).abs().max()))
    ref_loss /= batch
    got = float(loss.detach())
    if not abs(got - ref_loss) <= 2e-3 * abs(ref_loss):
        return f"wrong: loss {got:.6g} vs {ref_loss:.6g}"
    if not worst <= 2e-2 * scale:
        return f"wrong: gradient off by {worst:.3g} (largest {scale:.3g})"
    return None


def peer_status(wrong: str | None) -> str:
    """A peer's row status: "ok", or what its result got wrong, timed all the same.

    A peer that is wrong on a shape is still the code its users run, so its time is
    the comparison they would make. torch's float16 cross entropy over 65536 rows is
    one: the mean's total weight, 65536, is past float16's largest finite value
    (65504), and the gradient's target entries come out 0 instead of about -1/65536,
    off by their full size (the H200 bench of 65536x1000; on the CPU the loss itself is
    inf from 65504 rows on, tried by hand; tests/test_bench_train.py flags 65536 rows)."""
    return "ok" if wrong is None else f"{wrong}; timed anyway (a peer)"


def run(cases: list[Case] | None = None, csv_path: str | None = None, log=print,
        copy_gb_s: float | None = None, device: str = "cuda") -> list[Result]:
    """Check and time every provider's training step on each case, on ``device``
    ("cuda" or "cpu"; the cases default to that device's list)."""
    import torch

    timing = DeviceTiming(device)
    cases = cases or (TRAIN_CASES if timing.on_gpu else CPU_TRAIN_CASES)
    hardware = hardware_name(timing.on_gpu)
    copy_gb_s = copy_gb_s or timing.copy_bandwidth()
    results: list[Result] = []
    for case in cases:
        batch, classes = case.shape
        nbytes = floor_bytes(case)
        log(f"{case.label()}: floor {nbytes / copy_gb_s / 1e6:.4f} ms ({nbytes / 1e6:.1f} MB read + written)")
        rows = [Result(case, FLOOR, nbytes / copy_gb_s / 1e6, nbytes, "copy bandwidth", "ok")]
        gen = torch.Generator(device=device).manual_seed(0)
        logits = (torch.randn(batch, classes, device=device, generator=gen) * 2).to(getattr(torch, case.dtype))
        target = torch.randint(0, classes, (batch,), device=device, generator=gen)
        sets = timing.input_sets(nbytes // 2)
        inputs = [(logits if i == 0 else logits.clone(), target) for i in range(sets)]
        for name, kernel in kernel_steps(case, device):  # the kernels alone: graph replay, or perf_counter on the CPU
            try:
                launch, loss, grad = _kernel_launch(kernel, logits, target)
                grad.fill_(float("nan"))
                launch()
                timing.synchronize()
                wrong = check(case, loss, grad, logits, target)
                if wrong:
                    rows.append(Result(case, name, None, nbytes, "-", wrong))
                    log(f"  {name:<44} {wrong}")
                    continue
                launches = [_kernel_launch(kernel, x, t)[0] for x, t in inputs]
                ms, method = timing.kernels(launches)
                rows.append(Result(case, name, ms, nbytes, method, "ok"))
                log(f"  {name:<44} {ms:9.4f} ms  {nbytes / ms / 1e6:8.1f} GB/s  "
                    f"{nbytes / ms / 1e6 / copy_gb_s:6.1%} of copy")
                del launches, loss, grad
            except Exception as err:  # noqa: BLE001 - report and go on with the others
                timing.synchronize()
                rows.append(Result(case, name, None, nbytes, "-", f"failed: {type(err).__name__}: {str(err)[:160]}"))
                log(f"  {name:<44} failed: {err}")
            timing.release()
        for step in providers(case, device):
            try:
                loss, grad = step.run(logits.clone(), target)
                timing.synchronize()
                wrong = check(case, loss, grad, logits, target)
                del loss, grad
                if wrong and step.name.startswith("tvm_fusion"):  # ours wrong: a defect, never a time
                    rows.append(Result(case, step.name, None, nbytes, "-", wrong))
                    log(f"  {step.name:<44} {wrong}")
                    continue
                own = [(x.clone(), t) for x, t in inputs] if step.in_place else inputs
                calls = [lambda x=x, t=t: step.run(x, t) for x, t in own]
                ms, method = timing.calls(calls)
                del own, calls
                status = peer_status(wrong)
                rows.append(Result(case, step.name, ms, nbytes, method + " (fwd+bwd)", status))
                log(f"  {step.name:<44} {ms:9.4f} ms  {nbytes / ms / 1e6:8.1f} GB/s  "
                    f"{nbytes / ms / 1e6 / copy_gb_s:6.1%} of copy  {'' if wrong is None else status}")
            except Exception as err:  # noqa: BLE001 - report and go on with the others
                timing.synchronize()
                why = f"failed: {type(err).__name__}: {str(err)[:160]}"
                rows.append(Result(case, step.name, None, nbytes, "-", why))
                log(f"  {step.name:<44} {why}")
            timing.release()
        results.extend(rows)
        if csv_path:
            append_csv(rows, csv_path, hardware, copy_gb_s)
        del inputs, logits, target
        timing.release()
    return results
