"""BatchNorm for training: ``F.batch_norm`` and ``nn.BatchNorm1d/2d`` on fused kernels.

The forward is one ``bn_forward`` kernel (statistics, the running statistics'
update on the device, the normalize + affine map); the backward one ``bn_backward``
kernel (the dual reduction ``sum dy``, ``sum dy * xhat`` per channel, which is also
``dbias`` and ``dweight``, then the map ``dx``). The contract is torch's:

- training normalizes with the batch's biased variance and updates the running
  statistics (when given) with the unbiased one; eval normalizes with the running
  statistics; ``weight`` / ``bias`` are optional (a missing one is 1 / 0);
- ``momentum`` is a float or a 0-d tensor on the input's device. The modules pass
  ``1 / num_batches_tracked`` as a device tensor for ``momentum=None`` (torch's
  cumulative average), so a training step makes no host sync and can be captured in
  a CUDA graph (torch's own module reads ``num_batches_tracked`` on the host there);
- inputs of rank 2 to 5 ((N, C), (N, C, L), (N, C, H, W), (N, C, D, H, W)),
  contiguous or ``torch.channels_last`` (rank 4): channels-last runs the (M, C)
  kernels on the same memory, and ``y`` keeps the input's memory format; any other
  strides are copied to contiguous first; float16, bfloat16 or float32 (the
  statistics and parameters in float32: the parameters and running buffers may be
  of another dtype, as under ``model.half()``, and are converted around the kernel).

Three ways in, as for cross entropy: eager with a gradient wanted, a
``torch.autograd.Function`` over the launchers (no dispatcher: ``custom_op`` costs
about 60 us an eager call); eager without, the forward launcher; traced by
``torch.compile``, the custom ops ``tvm_fusion::batch_norm_forward`` and
``tvm_fusion::batch_norm_backward`` with fake functions and the autograd formula
(the op returns the new running statistics and the caller copies them into the
buffers, since an op that mutates its inputs cannot carry an autograd formula); the
same ops take meta tensors and tensor subclasses eagerly (shape inference). An empty
batch goes to ``F.batch_norm``. The gradients have no derivative of their own: under
``create_graph=True`` differentiating them raises an error, not a silent zero.

The modules subclass torch's, so their constructor, attributes, ``state_dict`` and
``isinstance`` checks are torch's; inputs the kernels do not cover (float64) go to
``F.batch_norm`` unchanged.
"""


import numbers
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

from .. import arrays, records, targets
from ..contracts.bn_backward import bn_backward_problem
from ..contracts.bn_forward import bn_forward_problem
from ..dispatch import kernel_for
from .function_apply import apply, first_order

OP = "tvm_fusion.torch.batch_norm"
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FORWARD: dict[tuple, Callable[..., tuple]] = records.register_cache({})
_BACKWARD: dict[tuple, Callable[..., tuple]] = records.register_cache({})
_CONSTANTS: dict[tuple, torch.Tensor] = {}  # momentum scalars, unit weights, zero biases


def batch_norm(input: torch.Tensor, running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
               weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, training: bool = False,
               momentum: float | torch.Tensor = 0.1, eps: float = 1e-5) -> torch.Tensor:
    """``torch.nn.functional.batch_norm`` on tvm_fusion's kernels, differentiable with
    respect to ``input``, ``weight`` and ``bias``; ``momentum`` may be a 0-d tensor
    on the input's device (the module docstring says more)."""
    if (getattr(running_mean, "requires_grad", False) or getattr(running_var, "requires_grad", False)) \
            and torch.is_grad_enabled():  # torch refuses them: no gradient, not a silent None
        raise RuntimeError(f"{OP}: running_mean and running_var must not require grad: batch_norm has no "
                           "gradient with respect to the running statistics (torch refuses them too)")
    if torch.compiler.is_compiling() or type(input) is not torch.Tensor or input.is_meta or not input.numel():
        return _not_launched(input, running_mean, running_var, weight, bias, training, momentum, eps)
    if torch.is_grad_enabled() and (input.requires_grad or getattr(weight, "requires_grad", False)
                                    or getattr(bias, "requires_grad", False)):
        return apply(_BatchNorm, input, running_mean, running_var, weight, bias, training, momentum, eps)
    return forward(input, running_mean, running_var, weight, bias, training, momentum, eps)[0]


def _not_launched(input, running_mean, running_var, weight, bias, training, momentum, eps):
    """What the eager launchers do not take: an empty input goes to ``F.batch_norm``
    (torch's empty batch: an empty output that still depends on ``weight`` and
    ``bias``, the running statistics unchanged); the rest to the custom ops, traced by
    ``torch.compile``, and eagerly for meta tensors (their fake functions give the
    shapes, as torch's own ops do on the meta device) and tensor subclasses
    (``FakeTensor``, ``Parameter``: the dispatcher hands the kernels plain tensors)."""
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"{OP}: input must be a torch tensor, got {type(input).__name__}")
    if not input.numel():  # momentum checked as a launch checks it: torch is handed 0.0, not it
        _momentum(momentum, input.device)
        return torch.nn.functional.batch_norm(input, running_mean, running_var, weight, bias, training, 0.0, eps)
    if not torch.compiler.is_compiling():  # traced, the op's launch checks what it runs
        _check_unlaunched(input, running_mean, running_var, weight, bias, training, eps)
    return _compiled(input, running_mean, running_var, weight, bias, training, momentum, eps)


def _check_unlaunched(input, running_mean, running_var, weight, bias, training, eps) -> None:
    """A launcher's checks for a call that builds none (meta tensors, fake ones,
    subclasses), which would otherwise get ``y``'s shape whatever its arguments. Where
    a size is symbolic the contract's checks of the sizes wait for the launch."""
    view = _check_arguments(input, running_mean, running_var, weight, bias, training)
    if all(isinstance(size, int) for size in input.shape):
        view.problem(input, bn_forward_problem, **_forward_options(running_mean, weight, bias, training, eps))


class _BatchNormMixin:
    """The forward of torch's ``_BatchNorm`` with the kernels' call in place of
    ``F.batch_norm`` and ``1 / num_batches_tracked`` computed on the device."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if input.dtype not in KERNEL_DTYPES:  # float64: torch's own module
            return super().forward(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # the cumulative average, without reading the count on the host
                momentum = torch.reciprocal(self.num_batches_tracked.to(torch.float32))
        use_batch = self.training or (self.running_mean is None and self.running_var is None)
        keep = not self.training or self.track_running_stats
        return batch_norm(input, self.running_mean if keep else None, self.running_var if keep else None,
                          self.weight, self.bias, use_batch, momentum, self.eps)


class BatchNorm1d(_BatchNormMixin, nn.BatchNorm1d):
    """``torch.nn.BatchNorm1d`` on tvm_fusion's kernels: (N, C) or (N, C, L) input."""


class BatchNorm2d(_BatchNormMixin, nn.BatchNorm2d):
    """``torch.nn.BatchNorm2d`` on tvm_fusion's kernels: (N, C, H, W) input, contiguous
    or channels-last."""


class BatchNorm3d(_BatchNormMixin, nn.BatchNorm3d):
    """``torch.nn.BatchNorm3d`` on tvm_fusion's kernels: (N, C, D, H, W) input, as the
    (N, C, D*H*W) kernels (other strides copied to contiguous first)."""


# -- the views ----------------------------------------------------------------------------
class _View:
    """How one input signature meets the kernels: the problem's shape and layout, the
    input as the kernel's array, and the output back in the input's form."""

    def __init__(self, input: torch.Tensor):
        rank = input.dim()
        if rank < 2 or rank > 5:
            raise ValueError(f"{OP}: expected input of rank 2 to 5 (N, C, ...), got shape {tuple(input.shape)}")
        if input.dtype not in KERNEL_DTYPES:
            raise TypeError(f"{OP}: input must be float16, bfloat16 or float32, got {input.dtype} "
                            "(tvm_fusion.torch.BatchNorm*d hand float64 to torch)")
        self.channels_last = output_format(input) is torch.channels_last
        self.copy = not (self.channels_last or input.is_contiguous())  # odd strides: one contiguous copy
        n, c, *rest = input.shape
        if self.channels_last:
            self.shape, self.layout = (n, *rest, c), "NHWC"
        elif rank == 5:  # (N, C, D, H, W) reduced to (N, C, D*H*W)
            self.shape, self.layout = (n, c, rest[0] * rest[1] * rest[2]), "NCHW"
        else:
            self.shape, self.layout = tuple(input.shape), "NCHW"
        self.input_shape = tuple(input.shape)
        # The shape the kernel takes x (and y, dy, dx) in: the input's own (its permuted
        # (N, H, W, C) when channels-last) where the kernel is built for it, so a call
        # makes no view (1.3-2.7 us each on the CI machine's host, five a training step).
        self.natural_shape = (n, *rest, c) if self.channels_last else self.input_shape
        self.take_as(self.shape)

    def take_as(self, shape: tuple[int, ...]) -> None:
        """The kernel takes its arrays in ``shape``: a view per call unless that is the
        natural shape."""
        self.kernel_shape, self.reshape = tuple(shape), tuple(shape) != self.natural_shape

    def problem(self, input: torch.Tensor, make_problem: Callable[..., Any], **options: Any) -> Any:
        """``make_problem(shape, dtype, layout, **options)`` on this view: the contract's checks."""
        return make_problem(self.shape, str(input.dtype).removeprefix("torch."), self.layout, **options)

    def kernel(self, input: torch.Tensor, make_problem: Callable[..., Any], as_called: tuple[str, ...],
               op: str = OP, **options: Any) -> tuple:
        """``(problem, kernel, kind)``: ``make_problem(shape, dtype, layout, **options)``
        on this view, dispatch's kernel for it on the input's device, compiled to take
        the parameters named in ``as_called`` (those of the input's shape) in the natural
        shape, and the input's array kind (outputs are allocated from it; ``op`` names
        the call in its errors)."""
        problem = self.problem(input, make_problem, **options)
        shapes = ()
        if tuple(problem.shape) != self.natural_shape:
            shapes = tuple((name, self.natural_shape) for name in as_called)
        self.take_as(self.natural_shape if shapes else problem.shape)
        kernel = kernel_for(problem, targets.for_device(input.device.type), input_shapes=shapes)
        taken = {name: tuple(shape) for name, shape, _ in kernel.params}
        if any(taken.get(name) != self.kernel_shape for name in as_called):  # a parameter name the kernel lacks
            raise RuntimeError(f"{op}: {kernel.candidate} takes {taken}, not {as_called} in {self.kernel_shape}")
        return problem, kernel, arrays.Kind(arrays.inspect(input, op, "input"))

    def to_kernel(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (of the input's shape) as the kernel's contiguous array: a view, or a
        copy when its strides (or 16-byte alignment) differ."""
        if self.channels_last:
            t = t.permute(0, 2, 3, 1)
        if not t.is_contiguous():
            t = t.contiguous()
        elif t.data_ptr() & 15:
            t = t.clone()
        return t.view(self.kernel_shape) if self.reshape else t

    def output(self, kind: arrays.Kind, dtype: str) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """A function allocating an output of the input's shape and memory format:
        ``(the tensor, its view as the kernel's parameter)``. The caller gets the
        tensor itself, not a view: autograd forbids an in-place op (``ReLU(inplace=True)``
        after the BatchNorm) on a view made inside a custom Function."""
        kernel_shape, reshape = self.kernel_shape, self.reshape
        if self.channels_last:
            allocate = kind.allocator(self.input_shape, dtype, torch.channels_last)

            def channels_last():
                out = allocate()
                arg = out.permute(0, 2, 3, 1)
                return out, arg.view(kernel_shape) if reshape else arg

            return channels_last
        allocate = kind.allocator(self.input_shape, dtype)

        def contiguous():
            out = allocate()
            return out, out.view(kernel_shape) if reshape else out

        return contiguous


def output_format(input: torch.Tensor) -> torch.memory_format:
    """The memory format of ``y`` and ``dx``: the input's, channels-last or contiguous."""
    if input.dim() == 4 and not input.is_contiguous() and input.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


# -- the launches -------------------------------------------------------------------------
def forward(input: torch.Tensor, running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
            weight: torch.Tensor | None, bias: torch.Tensor | None, training: bool,
            momentum: float | torch.Tensor, eps: float, in_place: bool = True) -> tuple:
    """``(y, save_mean, save_invstd, running_mean_out, running_var_out)``: the last two
    are the running buffers themselves (updated in place) unless ``in_place`` is False,
    then new tensors; None when nothing is updated."""
    # The vectors' dtypes are in the key: a launcher converts them to float32 for the
    # kernel, and one made for float buffers would truncate into integer ones.
    key = (input.shape, input.stride(), input.dtype, input.device, _dtype(running_mean), _dtype(running_var),
           _dtype(weight), _dtype(bias), training, training.__class__, eps, in_place)
    try:
        launch = _FORWARD.get(key)
    except TypeError:  # an unhashable eps, which the contract names
        launch = None
    if launch is None:
        launch = _forward_launcher(key, input, running_mean, running_var, weight, bias, training, eps, in_place)
    try:
        return launch(input, running_mean, running_var, weight, bias, momentum)
    except Exception:  # a cached launcher meets vectors of another shape or device: say which
        _check_arguments(input, running_mean, running_var, weight, bias, training)
        raise


def _forward_options(running_mean, weight, bias, training, eps) -> dict[str, Any]:
    """The forward problem's options for these arguments."""
    return {"affine": weight is not None or bias is not None, "training": training,
            "track_running": running_mean is not None, "eps": eps}


def _dtype(t: Any) -> Any:
    return None if t is None else getattr(t, "dtype", t.__class__)


def _check_arguments(input, running_mean, running_var, weight, bias, training) -> "_View":
    """The forward's arguments against the contract, or an error naming the first bad
    one; the input's view."""
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"{OP}: input must be a torch tensor, got {type(input).__name__}")
    if not isinstance(training, bool):
        raise TypeError(f"{OP}: training must be a bool, got {training!r}")
    if (running_mean is None) != (running_var is None):
        raise ValueError(f"{OP}: running_mean and running_var must both be given or both be None")
    if not training and running_mean is None:
        raise ValueError(f"{OP}: running_mean and running_var must be given in eval mode (training=False)")
    view = _View(input)
    for name, t in (("running_mean", running_mean), ("running_var", running_var), ("weight", weight),
                    ("bias", bias)):
        _check_vector(name, t, input.shape[1], input.device)
    return view


def _forward_launcher(key, input, running_mean, running_var, weight, bias, training, eps, in_place):
    view = _check_arguments(input, running_mean, running_var, weight, bias, training)
    channels = input.shape[1]
    options = _forward_options(running_mean, weight, bias, training, eps)
    affine, track = options["affine"], options["track_running"]
    problem, kernel, kind = view.kernel(input, bn_forward_problem, ("x", "y"), **options)
    func, device, updates = kernel.func, input.device, problem.updates_running
    new_y, new_vector = view.output(kind, kernel.outputs[0][2]), kind.allocator((channels,), "float32")
    weight_of, bias_of = _parameter(channels, device, 1.0), _parameter(channels, device, 0.0)

    def launch(input, running_mean, running_var, weight, bias, momentum):
        args = [view.to_kernel(input)]
        if affine:
            args += [weight_of(weight), bias_of(bias)]
        (y, y_arg), mean, invstd = new_y(), new_vector(), new_vector()
        if not track:
            func(*args, y_arg, mean, invstd)
            return y, mean, invstd, None, None
        rm, rv = _float32(running_mean), _float32(running_var)
        args += [rm, rv]
        if not updates:
            func(*args, y_arg, mean, invstd)
            return y, mean, invstd, None, None
        args.append(_momentum(momentum, device))
        if in_place and rm is running_mean and rv is running_var:
            func(*args, y_arg, mean, invstd, rm, rv)
            return y, mean, invstd, running_mean, running_var
        new_mean, new_var = new_vector(), new_vector()
        func(*args, y_arg, mean, invstd, new_mean, new_var)
        if in_place:  # buffers of another dtype or alignment: the update copied back
            return y, mean, invstd, running_mean.copy_(new_mean), running_var.copy_(new_var)
        return y, mean, invstd, new_mean, new_var

    _FORWARD[key] = launch
    return launch


def backward(grad: torch.Tensor, input: torch.Tensor, save_mean: torch.Tensor, save_invstd: torch.Tensor,
             weight: torch.Tensor | None, training: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dweight, dbias)`` (the last two float32) for upstream ``grad``."""
    key = (input.shape, input.stride(), input.dtype, input.device, weight is None, training)
    launch = _BACKWARD.get(key)
    if launch is None:
        launch = _backward_launcher(key, input, weight, training)
    return launch(grad, input, save_mean, save_invstd, weight)


def _backward_launcher(key, input, weight, training):
    view = _View(input)
    channels, device, dtype = input.shape[1], input.device, input.dtype
    _, kernel, kind = view.kernel(input, bn_backward_problem, ("x", "dy", "dx"), affine=weight is not None,
                                  training=training)
    func, affine = kernel.func, weight is not None
    new_dx, new_vector = view.output(kind, kernel.outputs[0][2]), kind.allocator((channels,), "float32")
    weight_of = _parameter(channels, device, 1.0)

    def launch(grad, input, save_mean, save_invstd, weight):
        if grad.dtype != dtype:
            grad = grad.to(dtype)
        args = [view.to_kernel(input), view.to_kernel(grad), save_mean, save_invstd]
        if affine:
            args.append(weight_of(weight))
        (dx, dx_arg), dweight, dbias = new_dx(), new_vector(), new_vector()
        func(*args, dx_arg, dweight, dbias)
        return dx, dweight, dbias

    _BACKWARD[key] = launch
    return launch


def _check_vector(name: str, t: Any, channels: int, device: torch.device) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{OP}: {name} must be a torch tensor or None, got {type(t).__name__}")
    if tuple(t.shape) != (channels,):
        raise ValueError(f"{OP}: {name} must have shape ({channels},) for input with {channels} channels, "
                         f"got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{OP}: {name} is on {t.device}, the input on {device}")
    if not t.is_floating_point():
        raise TypeError(f"{OP}: {name} must be floating point, got {t.dtype}")


def _float32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the kernel's (C,) float32 vector: itself when it already is one."""
    if t.dtype is torch.float32 and t.is_contiguous() and not t.data_ptr() & 15:
        return t
    return t.detach().to(torch.float32, memory_format=torch.contiguous_format).clone()


def _parameter(channels: int, device: torch.device, missing: float) -> Callable[[Any], torch.Tensor]:
    """A (C,) float32 parameter for the kernel: the given one, or a cached constant for
    a missing one. Not detached: the kernel only reads it and autograd's formula is
    ours, and tvm-ffi takes a tensor that requires grad as it is (a detach cost 4.7 us of
    host time on the H200's host under torch.profiler, three a training step)."""
    def get(t):
        if t is None:
            return _constant(("fill", channels, device, missing), lambda: torch.full((channels,), missing,
                                                                                     device=device))
        return _float32(t)

    return get


def _momentum(momentum: Any, device: torch.device) -> torch.Tensor:
    """The kernel's 0-d float32 momentum on ``device``: the given tensor, or a cached
    constant (made outside any CUDA graph capture: one made during a capture is used
    for that call only)."""
    if isinstance(momentum, torch.Tensor):
        if momentum.dim() != 0 or momentum.device != device:
            raise ValueError(f"{OP}: a momentum tensor must be 0-d on {device}, got shape "
                             f"{tuple(momentum.shape)} on {momentum.device}")
        return momentum if momentum.dtype is torch.float32 else momentum.to(torch.float32)
    if type(momentum) not in (float, int):  # the ABC's test (check_momentum) off the common path
        check_momentum(momentum)
    return _constant(("momentum", float(momentum), device), lambda: torch.full((), float(momentum), device=device))


def check_momentum(momentum: Any) -> None:
    """A number (np.float32 too, as torch takes it), or a TypeError naming it."""
    if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real):
        raise TypeError(f"{OP}: momentum must be a number or a 0-d tensor, got {momentum!r}")


def _constant(key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    value = _CONSTANTS.get(key)
    if value is None:
        value = make()
        if not (value.is_cuda and torch.cuda.is_current_stream_capturing()):
            _CONSTANTS[key] = value
    return value


# -- eager autograd -----------------------------------------------------------------------
class _BatchNorm(torch.autograd.Function):
    """The eager path: the launchers called directly, the batch's statistics saved."""

    @staticmethod
    def forward(ctx, input, running_mean, running_var, weight, bias, training, momentum, eps):
        y, mean, invstd, _, _ = forward(input, running_mean, running_var, weight, bias, training, momentum, eps)
        ctx.save_for_backward(input, mean, invstd, weight)
        ctx.training, ctx.bias_dtype = training, None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, grad):
        input, mean, invstd, weight = ctx.saved_tensors
        dx, dweight, dbias = backward(grad, input, mean, invstd, weight, ctx.training)
        return first_order(OP, (dx if ctx.needs_input_grad[0] else None, None, None,
                                None if weight is None else as_dtype(dweight, weight.dtype),
                                None if ctx.bias_dtype is None else as_dtype(dbias, ctx.bias_dtype), None, None,
                                None))


def as_dtype(grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A parameter's float32 gradient in the parameter's dtype (``Tensor.to`` of the
    same dtype still costs 1.25 us of host time)."""
    return grad if dtype is torch.float32 else grad.to(dtype)


# -- the custom ops, for torch.compile ----------------------------------------------------
def _compiled(input, running_mean, running_var, weight, bias, training, momentum, eps):
    if not isinstance(momentum, torch.Tensor):
        check_momentum(momentum)
        momentum = torch.full((), float(momentum), device=input.device)
    y, _, _, new_mean, new_var = torch.ops.tvm_fusion.batch_norm_forward(
        input, running_mean, running_var, weight, bias, training, momentum, eps)
    if training and running_mean is not None:
        with torch.no_grad():
            running_mean.copy_(new_mean)
            running_var.copy_(new_var)
    return y


@torch.library.custom_op("tvm_fusion::batch_norm_forward", mutates_args=())
def _forward_op(input: torch.Tensor, running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor],
                weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], training: bool,
                momentum: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                              torch.Tensor, torch.Tensor]:
    """``(y, save_mean, save_invstd, new running_mean, new running_var)``; the last two
    are empty when the running statistics are not updated."""
    y, mean, invstd, new_mean, new_var = forward(input, running_mean, running_var, weight, bias, training,
                                                 momentum, eps, in_place=False)
    if new_mean is None:
        new_mean, new_var = mean.new_empty(0), mean.new_empty(0)
    return y, mean, invstd, new_mean, new_var


@_forward_op.register_fake
def _(input, running_mean, running_var, weight, bias, training, momentum, eps):
    channels = input.shape[1]
    updated = channels if training and running_mean is not None else 0
    vector = input.new_empty((channels,), dtype=torch.float32)
    return (torch.empty_like(input, memory_format=output_format(input)), vector, vector.new_empty(channels),
            vector.new_empty(updated), vector.new_empty(updated))


def _setup_forward(ctx, inputs, output):
    input, _, _, weight, bias, training, _, _ = inputs
    _, mean, invstd, new_mean, new_var = output
    ctx.save_for_backward(input, mean, invstd, weight)
    ctx.training, ctx.bias_dtype = training, None if bias is None else bias.dtype
    ctx.mark_non_differentiable(mean, invstd, new_mean, new_var)


def _forward_op_backward(ctx, grad, *unused):
    input, mean, invstd, weight = ctx.saved_tensors
    dx, dweight, dbias = torch.ops.tvm_fusion.batch_norm_backward(grad, input, mean, invstd, weight, ctx.training)
    return (dx, None, None, None if weight is None else as_dtype(dweight, weight.dtype),
            None if ctx.bias_dtype is None else as_dtype(dbias, ctx.bias_dtype), None, None, None)


_forward_op.register_autograd(_forward_op_backward, setup_context=_setup_forward)


@torch.library.custom_op("tvm_fusion::batch_norm_backward", mutates_args=())
def _backward_op(grad: torch.Tensor, input: torch.Tensor, save_mean: torch.Tensor, save_invstd: torch.Tensor,
                 weight: Optional[torch.Tensor], training: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dweight, dbias)``, the last two float32."""
    return backward(grad, input, save_mean, save_invstd, weight, training)


@_backward_op.register_fake
def _(grad, input, save_mean, save_invstd, weight, training):
    vector = input.new_empty((input.shape[1],), dtype=torch.float32)
    return torch.empty_like(input, memory_format=output_format(input)), vector, vector.new_empty(vector.shape)
