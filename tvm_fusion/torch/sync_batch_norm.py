"""SyncBatchNorm: BatchNorm whose batch is the global one, over ``torch.distributed``.

Each rank holds a slice of the batch; the statistics are those of the whole batch.
Per layer and training step the forward makes one collective and the backward one:

Forward
1. This rank's fused ``bn_stats`` kernel: per channel ``mean`` and biased ``var`` of
   its ``n`` values, packed with the count into ``(n, mean, M2 = n var)``, 2C + 1
   float32 values (an empty slice packs zeros and launches nothing).
2. One ``all_gather`` of the packed buffer: every rank receives the
   (world, 2C + 1) table.
3. Chan et al.'s parallel combination, vectorized over the table on the device (no
   loop over ranks): ``N = sum n_r``, ``mean = sum n_r mean_r / N``,
   ``M2 = sum M2_r + sum n_r (mean_r - mean)^2``, ``var = M2 / N``. Empty ranks
   weigh 0.
4. The running statistics' update with the global count (``M2 / (N - 1)``, the
   unbiased variance, torch's meaning), on the device.
5. The normalize with our ``bn_forward`` kernel in eval form, the global ``mean`` and
   ``var`` given as its running statistics: ``y = (x - mean) * invstd * w + b``.

Why (count, mean, M2) gathered and not an ``all_reduce`` of (count, sum, sumsq): the
latter is the one-pass variance ``sumsq / N - mean^2``, which cancels
catastrophically when |mean| >> std (float32 keeps 24 bits: a mean of 1000 and a
std of 0.02 leave nothing of the variance), while Chan's form only adds
non-negative terms. torch all-gathers (mean, invstd, count) and rebuilds the
variance from ``invstd``, losing precision near ``eps``; M2 needs no ``eps``. The
buffers are tiny (2C + 1 floats a rank), so the collective's latency, not its
bytes, sets its cost either way (``tvm_fusion.torch.sync_cost`` measures both).

Backward
1. This rank's dual reduction ``sum dy``, ``sum dy * xhat`` per channel (our
   ``bn_backward`` kernel in eval form, whose ``dbias`` and ``dweight`` are those
   sums; its eval ``dx`` is not used).
2. One ``all_reduce`` (sum) of the packed (2C,) pair.
3. ``dx = w * invstd * (dy - sum_dy / N - xhat * sum_dy_xhat / N)``, the
   ``bn_backward_dx`` kernel, with the global means.
The weight and bias gradients returned are this rank's sums, as torch's
SyncBatchNorm returns: DistributedDataParallel's gradient all-reduce then averages
them over the ranks. (A rank with an empty slice returns zeros where torch returns
None: the same values, and its parameters get a gradient like every other rank's.)

Every rank takes part in every collective, an empty one too; nothing reads a
device value on the host (no ``.item()``), so a step can be captured in a CUDA
graph. One exception, on the CPU only (where reading a tensor syncs nothing): a
global count below 2 values per channel raises a ``ValueError`` naming the input
size, on every rank alike (torch's SyncBatchNorm checks the count only in a group of
one, never once it synchronizes; on a GPU the check would need a host sync, and the
running variance is then inf).

Where it does not synchronize it is ``tvm_fusion.torch.BatchNorm*d``, as torch's
module is torch's BatchNorm: eval mode, ``torch.distributed`` not initialized, or a
group of one. Unlike torch's, it accepts CPU tensors while distributed (Gloo): our
kernels run there too; torch's raises a ``ValueError`` for them. float64 input goes
to torch's SyncBatchNorm unchanged. Under ``torch.compile`` the synchronized layer
runs eagerly (``torch.compiler.disable``: a graph break).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import records
from ..api import bn_stats
from ..contracts.bn_backward_dx import bn_backward_dx_problem
from .batch_norm import (KERNEL_DTYPES, _BatchNormMixin, _float32, _parameter, _View, as_dtype, backward, forward,
                         output_format)
from .function_apply import apply, first_order

OP = "tvm_fusion.torch.sync_batch_norm"
_DX: dict[tuple, Callable[..., torch.Tensor]] = records.register_cache({})
# all_gather_single is the newer name of all_gather_into_tensor (one flat output;
# torch 2.13's Gloo takes it, as the tests show).
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class SyncBatchNorm(_BatchNormMixin, nn.SyncBatchNorm):
    """``torch.nn.SyncBatchNorm`` on tvm_fusion's kernels: its constructor
    (``num_features, eps, momentum, affine, track_running_stats, process_group``),
    attributes and ``state_dict``; ``momentum=None`` is the cumulative average with
    ``1 / num_batches_tracked`` on the device. The module docstring says how it
    synchronizes and when it does not."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        self._check_non_zero_input_channels(input)
        group = self._sync_group()
        if group is None or input.dtype not in KERNEL_DTYPES:
            return super().forward(input)  # our BatchNorm, or torch's SyncBatchNorm for float64
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # the cumulative average, without reading the count on the host
                momentum = torch.reciprocal(self.num_batches_tracked.to(torch.float32))
        keep = self.track_running_stats
        return sync_batch_norm(input, self.running_mean if keep else None, self.running_var if keep else None,
                               self.weight, self.bias, momentum, self.eps, group)

    def _sync_group(self) -> Any:
        """The process group to synchronize over, or None (eval, not initialized, one rank)."""
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return None
        group = self.process_group or dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group: Any = None) -> nn.Module:
        """:func:`convert_sync_batchnorm`."""
        return convert_sync_batchnorm(module, process_group)


def convert_sync_batchnorm(module: nn.Module, process_group: Any = None) -> nn.Module:
    """Every ``BatchNorm*d`` in ``module`` (torch's, ours, torch's SyncBatchNorm)
    replaced by :class:`SyncBatchNorm`, recursively, keeping its parameters and
    buffers (the same tensors), options and mode, as
    ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` does. A BatchNorm ``module``
    itself comes back as a new module; any other is changed in place and returned."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"convert_sync_batchnorm: module must be a torch.nn.Module, got {type(module).__name__}")
    converted = module
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        # affine without a bias: the constructor option of the torch versions that have one
        options = {"bias": False} if module.affine and module.bias is None else {}
        converted = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                  module.track_running_stats, process_group, **options)
        if module.affine:
            with torch.no_grad():
                converted.weight = module.weight
                converted.bias = module.bias
        converted.running_mean = module.running_mean
        converted.running_var = module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.training = module.training
        if hasattr(module, "qconfig"):
            converted.qconfig = module.qconfig
    for name, child in module.named_children():
        converted.add_module(name, convert_sync_batchnorm(child, process_group))
    return converted


@torch.compiler.disable
def sync_batch_norm(input: torch.Tensor, running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                    weight: torch.Tensor | None, bias: torch.Tensor | None, momentum: float | torch.Tensor,
                    eps: float, group: Any = None) -> torch.Tensor:
    """Training-mode BatchNorm of ``input`` over the batch of every rank of ``group``
    (the world by default), differentiable with respect to ``input``, ``weight`` and
    ``bias``; the running statistics (when given) are updated in place."""
    group = group or dist.group.WORLD
    if torch.is_grad_enabled() and (input.requires_grad or (weight is not None and weight.requires_grad)
                                    or (bias is not None and bias.requires_grad)):
        return apply(_SyncBatchNorm, input, running_mean, running_var, weight, bias, momentum, eps, group)
    return sync_forward(input, running_mean, running_var, weight, bias, momentum, eps, group)[0]


# -- the forward --------------------------------------------------------------------------
def sync_forward(input, running_mean, running_var, weight, bias, momentum, eps, group) -> tuple:
    """``(y, mean, invstd, count)``: the output and the global statistics (``count``
    a (1,) float32 tensor on the device)."""
    world = dist.get_world_size(group)
    moments = local_moments(input)
    table = moments.new_empty(world * moments.numel())  # flat: Gloo takes no (world, 2C + 1) output
    _ALL_GATHER(table, moments, group=group)
    count, mean, var, m2 = combine(table.view(world, moments.numel()))
    if input.device.type == "cpu" and float(count) < 2:  # a CPU tensor: no device sync
        raise ValueError(f"{OP}: expected more than 1 value per channel over the {world} ranks when training, "
                         f"got {int(count)} (this rank's input size {tuple(input.shape)})")
    if running_mean is not None:
        with torch.no_grad():
            update_running(running_mean, running_var, mean, m2 / (count - 1), momentum)
    if numel_per_channel(input) == 0:
        y = torch.empty_like(input, memory_format=output_format(input))
        return y, mean, torch.rsqrt(var + eps), count
    y, save_mean, save_invstd, _, _ = forward(input, mean, var, weight, bias, False, 0.0, eps)
    return y, save_mean, save_invstd, count


def numel_per_channel(input: torch.Tensor) -> int:
    return input.numel() // input.shape[1]


def local_moments(input: torch.Tensor) -> torch.Tensor:
    """This rank's ``(n, mean[C], M2[C])``, 2C + 1 float32 values on the input's
    device: ``bn_stats``'s mean and biased variance of its slice times ``n``, or zeros
    (no kernel launched) for an empty slice. ``n`` is exact up to 2^24 values per
    channel (float32)."""
    channels, n = input.shape[1], numel_per_channel(input)
    if n == 0:
        return torch.zeros(2 * channels + 1, dtype=torch.float32, device=input.device)
    view = _View(input)
    view.take_as(view.shape)  # bn_stats takes the view in its layout, NHWC channels last
    mean, var = bn_stats(view.to_kernel(input.detach()), view.layout)
    return torch.cat([mean.new_full((1,), float(n)), mean, var * n])


def combine(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chan et al.'s combination of the gathered (world, 2C + 1) table's rows:
    ``(N (1,), mean (C,), biased var (C,), M2 (C,))``, every rank's weight its count."""
    channels = (table.shape[1] - 1) // 2
    counts, means, m2s = table[:, :1], table[:, 1:1 + channels], table[:, 1 + channels:]
    count = counts.sum(dim=0)
    mean = (counts * means).sum(dim=0) / count
    m2 = m2s.sum(dim=0) + (counts * (means - mean).square()).sum(dim=0)
    return count, mean, m2 / count, m2


def update_running(running_mean: torch.Tensor, running_var: torch.Tensor, mean: torch.Tensor,
                   unbiased_var: torch.Tensor, momentum: float | torch.Tensor) -> None:
    """``running <- (1 - momentum) running + momentum batch``, in float32 on the
    device, into buffers of any float dtype."""
    keep = 1.0 - momentum
    for buffer, batch in ((running_mean, mean), (running_var, unbiased_var)):
        buffer.copy_(buffer.to(torch.float32) * keep + batch * momentum)


# -- the backward -------------------------------------------------------------------------
def sync_backward(grad, input, mean, invstd, count, weight, group, input_grad: bool) -> tuple:
    """``(dx or None, dweight, dbias)``: dx from the sums over every rank (one
    all_reduce, made only when ``input_grad``, as torch's), the parameters' gradients
    this rank's sums (float32)."""
    channels = input.shape[1]
    if numel_per_channel(input) == 0:
        dweight = torch.zeros(channels, dtype=torch.float32, device=input.device)
        dbias = torch.zeros_like(dweight)
    else:  # eval's dweight and dbias are the sums of dy * xhat and dy; its dx is unused
        _, dweight, dbias = backward(grad, input, mean, invstd, weight, False)
    if not input_grad:
        return None, dweight, dbias
    sums = torch.cat([dbias, dweight])
    dist.all_reduce(sums, dist.ReduceOp.SUM, group=group)
    if numel_per_channel(input) == 0:
        return torch.empty_like(input, memory_format=output_format(input)), dweight, dbias
    means = sums / count
    dx = backward_dx(grad, input, mean, invstd, weight, means[:channels], means[channels:])
    return dx, dweight, dbias


def backward_dx(grad: torch.Tensor, input: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
                weight: torch.Tensor | None, mean_dy: torch.Tensor, mean_dy_xhat: torch.Tensor) -> torch.Tensor:
    """``w * invstd * (grad - mean_dy - xhat * mean_dy_xhat)`` in the input's dtype and
    memory format: the ``bn_backward_dx`` kernel."""
    key = (input.shape, input.stride(), input.dtype, input.device, weight is None)
    launch = _DX.get(key)
    if launch is None:
        launch = _dx_launcher(key, input, weight)
    return launch(grad, input, mean, invstd, weight, mean_dy, mean_dy_xhat)


def _dx_launcher(key, input, weight):
    view = _View(input)
    channels, device, dtype = input.shape[1], input.device, input.dtype
    _, kernel, kind = view.kernel(input, bn_backward_dx_problem, ("x", "dy", "dx"), OP, affine=weight is not None)
    func, affine = kernel.func, weight is not None
    new_dx = view.output(kind, kernel.outputs[0][2])
    weight_of = _parameter(channels, device, 1.0)

    def launch(grad, input, mean, invstd, weight, mean_dy, mean_dy_xhat):
        if grad.dtype != dtype:
            grad = grad.to(dtype)
        args = [view.to_kernel(input), view.to_kernel(grad), _float32(mean), _float32(invstd)]
        if affine:
            args.append(weight_of(weight))
        dx, dx_arg = new_dx()
        func(*args, _float32(mean_dy), _float32(mean_dy_xhat), dx_arg)
        return dx

    _DX[key] = launch
    return launch


class _SyncBatchNorm(torch.autograd.Function):
    """The launchers and the two collectives, the global statistics saved."""

    @staticmethod
    def forward(ctx, input, running_mean, running_var, weight, bias, momentum, eps, group):
        y, mean, invstd, count = sync_forward(input, running_mean, running_var, weight, bias, momentum, eps, group)
        ctx.save_for_backward(input, mean, invstd, count, weight)
        ctx.group, ctx.bias_dtype = group, None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, grad):
        input, mean, invstd, count, weight = ctx.saved_tensors
        dx, dweight, dbias = sync_backward(grad, input, mean, invstd, count, weight, ctx.group,
                                           ctx.needs_input_grad[0])
        return first_order(OP, (dx, None, None, None if weight is None else as_dtype(dweight, weight.dtype),
                                None if ctx.bias_dtype is None else as_dtype(dbias, ctx.bias_dtype), None, None,
                                None))
