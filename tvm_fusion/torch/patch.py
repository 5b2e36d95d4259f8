"""``patch(model)`` / ``unpatch(model)``: tvm_fusion's modules in place of torch's.

``patch`` swaps, in place, every submodule of exactly these types and returns what
it replaced; ``unpatch`` puts the originals back:

- ``nn.BatchNorm1d`` / ``nn.BatchNorm2d`` / ``nn.BatchNorm3d`` ->
  :class:`tvm_fusion.torch.BatchNorm1d` / ``BatchNorm2d`` / ``BatchNorm3d`` with the same options and mode, holding the *same* parameter and
  buffer tensors (an optimizer made before the patch still steps them, and
  ``unpatch`` finds the trained values in the originals, and the stand-in's mode and
  any tensor ``.half()``, ``.to()`` or ``load_state_dict(assign=True)`` replaced);
- ``nn.CrossEntropyLoss`` -> :class:`PatchedCrossEntropyLoss` with the same
  arguments (weight buffer, ignore_index, reduction, label_smoothing).

The stand-ins run tvm_fusion's kernels on what they cover (float16, bfloat16 and
float32; (B, V) logits with class-index targets for the loss) and hand every other
call (float64, probability targets, (N, C, d1, ...) or unbatched losses) to torch's
functional form with the same arguments, so a patched model computes what it
computed before. Subclasses of these types are left alone (they may change
``forward``). A stand-in shares the original's hook tables (forward, backward and
state-dict hooks), so hooks registered before or after the patch run on it, and a
handle removes a hook from both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .batch_norm import BatchNorm1d, BatchNorm2d, BatchNorm3d
from .cross_entropy import CrossEntropyLoss

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int64, torch.int32)  # the kernels' targets; torch also takes uint8 ones
_PATCHED = "_tvm_fusion_patched"  # on the model: {name: its Replaced}


class PatchedCrossEntropyLoss(CrossEntropyLoss):
    """:class:`CrossEntropyLoss` for (B, V) logits and int64 or int32 class indices;
    torch's ``F.cross_entropy`` for every other form ``nn.CrossEntropyLoss`` accepts
    (uint8 class indices too: the kernels refuse them, torch takes them)."""

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if (input.dim() == 2 and target.dim() == 1 and target.dtype in _INDEX_DTYPES
                and input.dtype in _KERNEL_DTYPES):
            return super().forward(input, target)
        return F.cross_entropy(input, target, self.weight, ignore_index=self.ignore_index,
                               reduction=self.reduction, label_smoothing=self.label_smoothing)


@dataclass(frozen=True)
class Replaced:
    """One swapped submodule: its dotted name, the original and its stand-in."""

    name: str
    original: nn.Module
    replacement: nn.Module


def _cross_entropy(module: nn.CrossEntropyLoss) -> nn.Module:
    return PatchedCrossEntropyLoss(module.weight, ignore_index=module.ignore_index, reduction=module.reduction,
                                   label_smoothing=module.label_smoothing)


def _batch_norm(kind: type) -> Callable[[nn.Module], nn.Module]:
    def replace(module: nn.Module) -> nn.Module:
        replacement = kind(module.num_features, module.eps, module.momentum, module.affine,
                           module.track_running_stats, device="meta")
        for name in ("weight", "bias"):  # the same Parameter objects
            setattr(replacement, name, getattr(module, name))
        for name in ("running_mean", "running_var", "num_batches_tracked"):  # the same buffers
            replacement.register_buffer(name, getattr(module, name))
        return replacement

    return replace


# Exact types only: a subclass may change forward.
_STAND_INS: dict[type, Callable[[nn.Module], nn.Module]] = {
    nn.CrossEntropyLoss: _cross_entropy,
    nn.BatchNorm1d: _batch_norm(BatchNorm1d),
    nn.BatchNorm2d: _batch_norm(BatchNorm2d),
    nn.BatchNorm3d: _batch_norm(BatchNorm3d),
}


def _share_hooks(original: nn.Module, stand_in: nn.Module) -> None:
    """The stand-in uses the original's hook tables themselves (the same dicts): a
    forward hook on a BatchNorm (activation statistics, say) did not run after the
    patch."""
    for name, table in vars(original).items():
        if "hook" in name and isinstance(table, dict):
            setattr(stand_in, name, table)
    stand_in._is_full_backward_hook = original._is_full_backward_hook


def patch(model: nn.Module) -> list[Replaced]:
    """Swap ``model``'s ``nn.BatchNorm1d``, ``nn.BatchNorm2d``, ``nn.BatchNorm3d`` and
    ``nn.CrossEntropyLoss`` submodules for tvm_fusion's, in place; returns the swaps (empty when there was
    nothing to swap). Patching twice swaps nothing more."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch: model must be a torch.nn.Module, got {type(model).__name__}")
    if type(model) in _STAND_INS:
        raise TypeError(f"patch: the model itself is an nn.{type(model).__name__}; use "
                        f"tvm_fusion.torch's {type(model).__name__} directly")
    swaps = []
    for name, module in list(model.named_modules()):
        make = _STAND_INS.get(type(module))
        if make is not None:
            replacement = make(module)
            replacement.train(module.training)
            _share_hooks(module, replacement)
            model.set_submodule(name, replacement)
            swaps.append(Replaced(name, module, replacement))
    registry = model.__dict__.setdefault(_PATCHED, {})
    for swap in swaps:
        registry[swap.name] = swap
    return swaps


def unpatch(model: nn.Module) -> list[Replaced]:
    """Put back every module ``patch`` swapped in ``model``; returns those swaps
    (original and the stand-in it removes). A stand-in the caller has since removed or
    replaced is left as the caller left it: the original went over the caller's module,
    and a removed one raised torch's AttributeError halfway, the rest never put back."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"unpatch: model must be a torch.nn.Module, got {type(model).__name__}")
    registry = model.__dict__.pop(_PATCHED, {})
    restored = []
    for name, swap in registry.items():
        stand_in, original = _submodule(model, name), swap.original
        if stand_in is not swap.replacement:
            continue
        _carry_state(stand_in, original)
        restored.append(Replaced(name, original, stand_in))
        model.set_submodule(name, original)
    return restored


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    """The submodule at ``name``, or None where there is none (any longer)."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _carry_state(stand_in: nn.Module, original: nn.Module) -> None:
    """What happened to the stand-in since the patch, onto the original: its mode
    (``model.eval()``), and each parameter or buffer that was replaced rather than
    updated in place (``model.half()`` or ``.to(device)`` replace the buffers,
    ``load_state_dict(assign=True)`` both); in-place updates are already shared."""
    original.train(stand_in.training)
    for store in ("_parameters", "_buffers"):
        mine, theirs = getattr(original, store), getattr(stand_in, store)
        for name in mine:
            if name in theirs and theirs[name] is not mine[name]:
                mine[name] = theirs[name]
