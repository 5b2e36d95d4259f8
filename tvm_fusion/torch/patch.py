"""``patch(model)`` / ``unpatch(model)``: tvm_fusion's modules in place of torch's.

``patch`` swaps every ``nn.CrossEntropyLoss`` submodule of a model for
:class:`tvm_fusion.torch.CrossEntropyLoss` with the same arguments (weight buffer,
ignore_index, reduction, label_smoothing) and returns what it replaced;
``unpatch`` puts the originals back. The stand-in runs tvm_fusion's kernels on what
they cover, (B, V) float16/bfloat16/float32 logits with class-index targets, and
hands every other call (probability targets, (N, C, d1, ...) or unbatched inputs,
float64) to
``torch.nn.functional.cross_entropy`` with the same arguments, so a patched model
computes what it computed before.

BatchNorm modules are not swapped yet: tvm_fusion has no fused BatchNorm training
kernels so far, and a module that normalized with framework ops would be slower than
torch's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .cross_entropy import CrossEntropyLoss

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_PATCHED = "_tvm_fusion_patched"  # on the model: {name: original module}


class PatchedCrossEntropyLoss(CrossEntropyLoss):
    """:class:`CrossEntropyLoss` for (B, V) logits and class indices; torch's
    ``F.cross_entropy`` for every other form ``nn.CrossEntropyLoss`` accepts."""

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if (input.dim() == 2 and target.dim() == 1 and not target.is_floating_point()
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


def patch(model: nn.Module) -> list[Replaced]:
    """Swap ``model``'s ``nn.CrossEntropyLoss`` submodules for tvm_fusion's, in place;
    returns the swaps (empty when there was nothing to swap). Patching twice swaps
    nothing more."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch: model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.CrossEntropyLoss):
        raise TypeError("patch: the model itself is an nn.CrossEntropyLoss; use "
                        "tvm_fusion.torch.CrossEntropyLoss(...) directly")
    swaps = []
    for name, module in list(model.named_modules()):
        if type(module) is nn.CrossEntropyLoss:  # subclasses may change forward: left alone
            replacement = PatchedCrossEntropyLoss(module.weight, ignore_index=module.ignore_index,
                                                  reduction=module.reduction,
                                                  label_smoothing=module.label_smoothing)
            replacement.train(module.training)
            model.set_submodule(name, replacement)
            swaps.append(Replaced(name, module, replacement))
    registry = model.__dict__.setdefault(_PATCHED, {})
    for swap in swaps:
        registry[swap.name] = swap.original
    return swaps


def unpatch(model: nn.Module) -> list[Replaced]:
    """Put back every module ``patch`` swapped in ``model``; returns those swaps
    (original and the stand-in it removes)."""
    registry = model.__dict__.pop(_PATCHED, {})
    restored = []
    for name, original in registry.items():
        restored.append(Replaced(name, original, model.get_submodule(name)))
        model.set_submodule(name, original)
    return restored
