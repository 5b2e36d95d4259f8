"""Cross entropy for training: the loss and its gradient in one kernel.

When the logits need a gradient, the forward runs the *fused* gradient kernel
(``cross_entropy_grad``, mode "fused"): one read of the logits gives the loss and
``dlogits`` for an upstream gradient of 1, written while the row is in registers.
The backward only scales that gradient by the upstream one, in place: a reduced
loss's ``dloss`` is a scalar, and the scaling kernel skips all work on the device
when it is 1 (``tvm_fusion.torch.scale``); "none" scales each row. So a training
step that ends at the loss reads the logits once and writes the gradient once.

Three ways in, one kernel:

- eager, the logits need a gradient: a ``torch.autograd.Function`` around the
  launcher, no dispatcher (``torch.library.custom_op`` costs about 60 us an eager
  call);
- eager, no gradient wanted: ``tvm_fusion.cross_entropy`` (the forward kernel);
- traced by ``torch.compile`` (or ``torch.export``): the custom ops
  ``tvm_fusion::cross_entropy_fused`` and ``tvm_fusion::cross_entropy``, with fake
  (meta) functions and the autograd formula registered, so ``fullgraph=True``
  traces a model through them without a graph break; the same ops take meta tensors
  and tensor subclasses eagerly (``FakeTensorMode``, ``Parameter``: shape inference).

The gradient has no derivative of its own: under ``create_graph=True`` differentiating
it raises an error (``function_apply.first_order``), not a silent zero.

``inplace_backward=True`` writes the gradient over the logits during the forward
(no B x V allocation; Liger's and Quack's option) and bumps the logits' version
counter, so autograd refuses any saved use of the overwritten values. The kernels
that do it are built for it (``in_place`` problems: no ``__restrict__``, every logit
of a row read before a block barrier that precedes its first store); where none
applies, or the logits are not one contiguous 16-byte aligned tensor, the gradient
is computed out of place and copied over the logits. Under ``torch.compile`` the
option has no effect: a custom op that mutates its input cannot carry an autograd
formula (torch.library), so the compiled graph gets the gradient in a new buffer.

A bad target raises :class:`tvm_fusion.TargetOutOfRangeError` as the forward API
does (on CUDA at a later call or at ``tvm_fusion.check_targets()``);
``check_targets=False`` reads nothing and lets a training step be captured in a
CUDA graph.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, Optional  # no postponed annotations: custom_op reads them

import torch

from .. import api, arrays, records, registry, target_check, targets
from ..contracts import TargetOutOfRangeError
from ..contracts.common import check_bool
from ..contracts.cross_entropy import check_arguments
from ..contracts.cross_entropy_grad import cross_entropy_grad_problem
from ..dispatch import kernel_for
from .function_apply import apply, first_order
from .scale import scale_in_place

OP = "tvm_fusion.torch.cross_entropy"
_RETURNED = ("loss", "dlogits")  # the kernel's outputs the caller gets; the rest are scratch
_LAUNCHERS: dict[tuple, Callable[..., tuple[Any, Any]]] = records.register_cache({})


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    check_targets: bool = True,
    inplace_backward: bool = False,
) -> torch.Tensor:
    """``torch.nn.functional.cross_entropy`` of (B, V) ``logits`` against class
    indices ``target`` (B,), differentiable with respect to ``logits``.

    The loss is float32 (0-d for "mean" and "sum"); the gradient has the logits'
    dtype. Same options and meaning as torch's; ``check_targets`` as in
    :func:`tvm_fusion.cross_entropy`. ``inplace_backward=True`` (when the logits
    need a gradient) overwrites ``logits`` with the gradient during this call: read
    nothing from them afterwards (the module docstring says more)."""
    if not isinstance(inplace_backward, bool):
        raise TypeError(f"{OP}: inplace_backward must be a bool, got {inplace_backward!r}")
    if getattr(weight, "requires_grad", False) and torch.is_grad_enabled():  # torch refuses it: no silent None
        raise RuntimeError(f"{OP}: weight requires grad, but the loss has no gradient with respect to the class "
                           "weights (torch's cross_entropy refuses them too): pass weight.detach()")
    if torch.compiler.is_compiling() or type(logits) is not torch.Tensor or logits.is_meta:
        return _through_ops(logits, target, weight, ignore_index, reduction, label_smoothing, check_targets)
    if logits.requires_grad and torch.is_grad_enabled():
        if inplace_backward and (logits.is_leaf or (logits._is_view() and logits._base.is_leaf)):  # torch's rule
            raise RuntimeError(f"{OP}: inplace_backward=True would overwrite logits that are (a view of) a leaf "
                               "requiring grad (a parameter, or a tensor made with requires_grad=True); torch "
                               "forbids in-place writes to such tensors: pass logits computed from them instead")
        return apply(_CrossEntropy, logits, target, weight, ignore_index, reduction, label_smoothing, check_targets,
                     inplace_backward)
    return api.cross_entropy(logits, target, weight, ignore_index, reduction, label_smoothing, check_targets)


def _through_ops(logits, target, weight, ignore_index, reduction, label_smoothing, check_targets):
    """The custom ops: traced by ``torch.compile``, and eagerly for what the launcher
    cannot take: meta tensors (their fake functions give the loss's shape, as torch's
    own ops do on the meta device) and tensor subclasses (``FakeTensor``, ``Parameter``;
    the dispatcher hands the kernel plain tensors). ``inplace_backward`` has no effect
    here (the module docstring says why)."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{OP}: logits must be a torch tensor, got {type(logits).__name__}; "
                        "tvm_fusion.cross_entropy takes numpy and TVM arrays")
    if not torch.compiler.is_compiling():  # traced, the op's launch checks what it runs
        _check_unlaunched(logits, target, weight, ignore_index, reduction, label_smoothing, check_targets)
    if logits.requires_grad and torch.is_grad_enabled():
        return torch.ops.tvm_fusion.cross_entropy_fused(
            logits, target, weight, ignore_index, reduction, label_smoothing, check_targets)[0]
    return torch.ops.tvm_fusion.cross_entropy(logits, target, weight, ignore_index, reduction, label_smoothing,
                                             check_targets)


def _check_unlaunched(logits, target, weight, ignore_index, reduction, label_smoothing, check_targets) -> None:
    """A launcher's checks for a call that builds none (meta tensors, fake ones,
    subclasses), which would otherwise get a loss's shape whatever its arguments, and
    before the dispatcher's own type errors. A symbolic size counts as 1 here (not
    specialized); the launch checks its value."""
    def described(name: str, t: Any) -> tuple[tuple[int, ...], str]:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{OP}: {name} must be a torch tensor, got {type(t).__name__}")
        if t.device != logits.device:
            raise ValueError(f"{OP}: {name} must be on the same device as logits ({logits.device}), got {t.device}")
        return tuple(size if isinstance(size, int) else 1 for size in t.shape), str(t.dtype).removeprefix("torch.")

    check_bool(OP, "check_targets", check_targets)
    check_arguments(OP, *described("logits", logits), *described("target", target),
                    *((None, "float32") if weight is None else described("weight", weight)),
                    ignore_index, reduction, label_smoothing)


class CrossEntropyLoss(torch.nn.Module):
    """``torch.nn.CrossEntropyLoss`` on tvm_fusion's kernels (class-index targets,
    (B, V) logits), with the same arguments, plus ``check_targets`` and
    ``inplace_backward``."""

    def __init__(self, weight: torch.Tensor | None = None, size_average: Any = None, ignore_index: int = -100,
                 reduce: Any = None, reduction: str = "mean", label_smoothing: float = 0.0,
                 check_targets: bool = True, inplace_backward: bool = False) -> None:
        super().__init__()
        if size_average is not None or reduce is not None:  # torch's deprecated pair
            reduction = torch.nn._reduction.legacy_get_string(size_average, reduce, emit_warning=True)
        self.register_buffer("weight", weight)
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing, self.check_targets = label_smoothing, check_targets
        self.inplace_backward = inplace_backward

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy(input, target, self.weight, self.ignore_index, self.reduction,
                             self.label_smoothing, self.check_targets, self.inplace_backward)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, check_targets={self.check_targets}, "
                f"inplace_backward={self.inplace_backward}")


# -- the launch ------------------------------------------------------------------------
def loss_and_grad(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
                  ignore_index: int, reduction: str, label_smoothing: float,
                  check_targets: bool, in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss and ``dlogits`` for an upstream gradient of 1, from one kernel;
    ``in_place``: ``dlogits`` is ``logits``, overwritten."""
    try:
        key = (api.ce_key(logits, target, weight, ignore_index, reduction, label_smoothing, check_targets), in_place)
        launch = _LAUNCHERS.get(key)
    except TypeError:  # an unhashable option: the contract names it, or takes it uncached (api.keep)
        key, launch = None, None
    if launch is None:
        launch = _launcher(key, logits, target, weight, ignore_index, reduction, label_smoothing, check_targets,
                           in_place)
    return launch(logits, target, weight)


def _launcher(key, logits, target, weight, ignore_index, reduction, label_smoothing, check_targets, in_place):
    la, ta, wa = api.inspect_ce_arguments(OP, logits, target, weight, check_targets)
    if la.kind != "torch":
        raise TypeError(f"{OP}: logits must be a torch tensor, got {type(logits).__name__}; "
                        "tvm_fusion.cross_entropy takes numpy and TVM arrays")
    problem = cross_entropy_grad_problem(
        la.shape, la.dtype, ta.shape, ta.dtype, None if wa is None else wa.shape,
        "float32" if wa is None else wa.dtype, ignore_index, reduction, label_smoothing, mode="fused",
    )
    arrays.check_same_place(OP, la, target=ta, weight=wa)
    kind = arrays.Kind(la)
    if problem.batch == 0:  # torch's loss of no rows, and an empty gradient
        return api.keep(_LAUNCHERS, key, lambda logits, target, weight: (
            api._empty_batch_loss(la, reduction), logits if in_place else torch.empty_like(logits)))
    device_target = targets.for_device(la.device_type)
    if in_place:
        in_place_problem = dataclasses.replace(problem, in_place=True)
        if logits.is_contiguous() and registry.applicable(in_place_problem, device_target):
            kernel = kernel_for(in_place_problem, device_target)
            return api.keep(_LAUNCHERS, key, _kernel_launcher(kernel, kind, la, ta, wa, problem, check_targets,
                                                              ignore_index, in_place=True))
        out_of_place = loss_and_grad  # no kernel for it: the gradient copied over the logits

        def launch(logits, target, weight):
            loss, grad = out_of_place(logits, target, weight, ignore_index, reduction, label_smoothing,
                                      check_targets)
            return loss, logits.copy_(grad)

        return api.keep(_LAUNCHERS, key, launch)
    kernel = kernel_for(problem, device_target)
    return api.keep(_LAUNCHERS, key, _kernel_launcher(kernel, kind, la, ta, wa, problem, check_targets, ignore_index))


def _kernel_launcher(kernel, kind, la, ta, wa, problem, check_targets, ignore_index, in_place=False):
    """The launch of ``kernel`` for the arguments' signatures; ``in_place``: the
    gradient output is the logits themselves (contiguous; a misaligned tensor goes
    through an aligned copy, which is then copied back)."""
    func, batch, classes = kernel.func, problem.batch, problem.classes
    # Outputs in the kernel's order: the loss and dlogits are the caller's, the flag
    # goes where the check reads it, the rest (lse, row losses, denominators) are
    # scratch, one set per stream.
    names = [name for name, _, _ in kernel.outputs]
    flag_at, loss_at, grad_at = names.index("first_bad_row"), names.index("loss"), names.index("dlogits")
    scratch_at = [i for i, name in enumerate(names) if name not in _RETURNED]
    scratch = kind.scratch([kernel.outputs[i][1:] for i in scratch_at])
    new_loss, new_grad = kind.allocator(*kernel.outputs[loss_at][1:]), kind.allocator(*kernel.outputs[grad_at][1:])
    width = len(names)
    inputs = api.ce_inputs(kind, la, ta, wa, batch, classes)
    torch_cuda = kind.cuda
    deferred = check_targets and torch_cuda
    device_id = la.device_id  # not la itself: the launcher must not keep the first call's tensors alive
    sink = target_check.sink(device_id) if torch_cuda and not check_targets else None

    def launch(logits, target, weight):
        args = inputs(logits, target, weight)
        outs = [None] * width
        for i, buffer in zip(scratch_at, scratch()):
            outs[i] = buffer
        outs[loss_at], outs[grad_at] = new_loss(), args[0] if in_place else new_grad()
        if sink is not None:
            outs[flag_at] = sink
            func(*args, *outs)
        elif deferred:
            args += outs
            target_check.launch_checked(func, args, len(args) - width + flag_at, device_id, batch, classes,
                                        ignore_index, target)
        else:
            func(*args, *outs)
            if check_targets:
                row = outs[flag_at].item()  # int(t[0]) makes a view first: 1.6 us against 0.2
                if row < batch:
                    raise TargetOutOfRangeError(row, int(target[row]), classes, ignore_index)
        if in_place and outs[grad_at] is not logits:  # an aligned copy (or a view) took the gradient
            return outs[loss_at], logits.copy_(outs[grad_at].view(logits.shape))
        return outs[loss_at], outs[grad_at]

    return launch


def scaled_grad(dlogits: torch.Tensor, grad_loss: torch.Tensor, reduction: str, in_place: bool) -> torch.Tensor:
    """``dlogits`` (for dloss = 1) times the upstream gradient: a scalar for "mean"
    and "sum", one value per row for "none"."""
    if in_place and reduction != "none" and dlogits.is_contiguous():  # no traffic when dloss is 1
        return scale_in_place(dlogits, grad_loss.float().contiguous())
    scale = grad_loss.unsqueeze(1) if reduction == "none" else grad_loss
    return dlogits.mul_(scale) if in_place else dlogits * scale.to(dlogits.dtype)


class _CrossEntropy(torch.autograd.Function):
    """The eager path: the launcher called directly, the gradient saved from the
    forward and scaled in place in the backward."""

    @staticmethod
    def forward(ctx, logits, target, weight, ignore_index, reduction, label_smoothing, check_targets,
                inplace_backward):
        loss, dlogits = loss_and_grad(logits, target, weight, ignore_index, reduction, label_smoothing,
                                      check_targets, inplace_backward)
        if inplace_backward:  # the logits now hold the gradient: autograd's saved uses of them must fail
            torch.autograd.graph.increment_version(logits)
            # dlogits is the logits tensor itself, in the graph (its grad_fn leads back into
            # the layers that made it): the backward hands out a detached alias instead
            dlogits = dlogits.detach()
        ctx.dlogits, ctx.reduction = dlogits, reduction  # not saved tensors: scaled in place once
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.dlogits is None:
            raise RuntimeError(
                f"{OP}: backward ran twice through the same cross entropy (retain_graph=True); the "
                "gradient saved by the forward was scaled in place by the first backward"
            )
        grad = scaled_grad(ctx.dlogits, grad_loss, ctx.reduction, in_place=True)
        ctx.dlogits = None
        return first_order(OP, (grad, None, None, None, None, None, None, None))


# -- the custom ops, for torch.compile ----------------------------------------------------
@torch.library.custom_op("tvm_fusion::cross_entropy_fused", mutates_args=())
def _fused_op(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor], ignore_index: int,
              reduction: str, label_smoothing: float, check_targets: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return loss_and_grad(logits, target, weight, ignore_index, reduction, label_smoothing, check_targets)


@_fused_op.register_fake
def _(logits, target, weight, ignore_index, reduction, label_smoothing, check_targets):
    return _fake_loss(logits, reduction), torch.empty_like(logits)


def _setup_context(ctx, inputs, output):
    ctx.reduction = inputs[4]
    ctx.save_for_backward(output[1])
    ctx.mark_non_differentiable(output[1])


def _fused_backward(ctx, grad_loss, grad_dlogits):
    (dlogits,) = ctx.saved_tensors
    return scaled_grad(dlogits, grad_loss, ctx.reduction, in_place=False), None, None, None, None, None, None


_fused_op.register_autograd(_fused_backward, setup_context=_setup_context)


@torch.library.custom_op("tvm_fusion::cross_entropy", mutates_args=())
def _forward_op(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor], ignore_index: int,
                reduction: str, label_smoothing: float, check_targets: bool) -> torch.Tensor:
    return api.cross_entropy(logits, target, weight, ignore_index, reduction, label_smoothing, check_targets)


@_forward_op.register_fake
def _(logits, target, weight, ignore_index, reduction, label_smoothing, check_targets):
    return _fake_loss(logits, reduction)


def _fake_loss(logits: torch.Tensor, reduction: str) -> torch.Tensor:
    shape = (logits.shape[0],) if reduction == "none" else ()
    return logits.new_empty(shape, dtype=torch.float32)
