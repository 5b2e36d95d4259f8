"""``fold(model)``: inference BatchNorm folded into the conv or linear layer before it.

The PyTorch form of the Relax ``FoldBatchNorm`` pass, under the same contract. An
eval-mode BatchNorm with running statistics is an affine map per channel: with
``s = gamma / sqrt(running_var + eps)``::

    W' = W * s   (per output channel: the weight's axis 0, for Conv1d, Conv2d and
                  Conv3d of any groups, and Linear)
    b' = (b - running_mean) * s + beta        (b = 0 when the layer has no bias)

so ``bn(layer(x)) == layer'(x)`` and the BatchNorm becomes ``nn.Identity``. The
arithmetic is float64; the new weight and bias keep the layer's dtype.

The model is traced with ``torch.fx`` to find each BatchNorm's input. A BatchNorm
stays, with its reason, unless:

- it is in eval mode and has running statistics (``track_running_stats``);
- its input is the output of a ``Conv1d``, ``Conv2d``, ``Conv3d`` or ``Linear`` submodule call,
  and nothing else reads that output;
- the layer and the BatchNorm are each called once in the traced forward (a shared
  layer would change its other uses), the layer's weight and bias are its own (not
  tied to another module's, not read by the forward directly, not parametrized as
  ``weight_norm`` or ``spectral_norm`` make them), and neither has hooks;
- the layer's output channels equal the BatchNorm's features and lie on dim 1 of
  its input: always true for ``Conv2d`` -> ``BatchNorm2d`` (4-D) and ``Conv3d`` ->
  ``BatchNorm3d`` (5-D); for ``Conv1d`` and
  ``Linear`` -> ``BatchNorm1d`` the input's rank must be known, so they fold only
  when ``example_inputs`` are given and the BatchNorm's input is 3-D (Conv1d) or
  2-D (Linear) there (a Linear over (N, L, F) feeding ``BatchNorm1d(L)`` would
  normalize the wrong axis).

The given model is not modified: ``fold`` returns a folded deep copy (example inputs
run through it in eval mode, so no BatchNorm's statistics move).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
# A conv whose output has its channels on dim 1 at a known rank, and the BatchNorm of that rank.
CONV_NORMS = {nn.Conv2d: nn.BatchNorm2d, nn.Conv3d: nn.BatchNorm3d}


def fold(model: nn.Module, *example_inputs: Any) -> tuple[nn.Module, dict[str, str]]:
    """A deep copy of ``model`` with every foldable BatchNorm folded into the layer
    before it (and replaced by ``nn.Identity``), and ``{name: reason}`` for every
    BatchNorm kept. ``example_inputs`` (the forward's arguments) let Conv1d and
    Linear pairs be checked and folded; see the module docstring."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fold: model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError("fold: a TorchScript module cannot be traced by torch.fx; fold the nn.Module, then script it")
    try:
        folded = copy.deepcopy(model)
    except RuntimeError as err:  # a computed tensor attribute (torch.nn.utils.weight_norm's weight)
        raise ValueError(f"fold: the model cannot be deep-copied, and fold folds a copy: {err}") from err
    modules = dict(folded.named_modules())
    norms = [name for name, module in modules.items() if isinstance(module, BATCH_NORMS)]
    try:
        graph = torch.fx.symbolic_trace(folded)
    except Exception as err:  # noqa: BLE001 - a model fx cannot trace keeps every BatchNorm
        return folded, {name: f"torch.fx cannot trace the model: {type(err).__name__}: {err}" for name in norms}
    if example_inputs:
        from torch.fx.passes.shape_prop import ShapeProp

        modes = {module: module.training for module in folded.modules()}
        folded.eval()  # a BatchNorm in training mode would update its statistics
        try:
            with torch.no_grad():
                ShapeProp(graph).propagate(*example_inputs)
        except Exception as err:  # ShapeProp's RuntimeError names an FX node; the model's own error is its cause
            cause = err.__cause__ or err
            raise ValueError(f"fold: the model fails on example_inputs (the forward's arguments), with "
                             f"{type(cause).__name__}: {cause}") from err
        finally:
            for module, training in modes.items():
                module.training = training
    calls: dict[str, int] = {}
    for node in graph.graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    # Every name a tensor is reachable by (tied weights), and the attributes the traced
    # forward reads directly (F.conv2d(x, self.conv.weight)).
    names: dict[int, list[str]] = {}
    for name, tensor in [*folded.named_parameters(remove_duplicate=False),
                         *folded.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), []).append(name)
    read = {node.target for node in graph.graph.nodes if node.op == "get_attr"}
    kept: dict[str, str] = {name: "not called in the traced forward" for name in norms}
    for node in graph.graph.nodes:
        if node.op != "call_module" or node.target not in kept:
            continue
        bn = modules[node.target]
        reason = _why_kept(node, bn, modules, calls, bool(example_inputs)) or _altered(node, modules, names, read)
        if reason is not None:
            kept[node.target] = reason
            continue
        layer = modules[node.args[0].target]
        _fold_into(layer, bn)
        folded.set_submodule(node.target, nn.Identity())
        del kept[node.target]
    return folded, kept


def _why_kept(node, bn, modules, calls, shapes_known: bool) -> str | None:
    if bn.training:
        return "training mode (the batch's statistics, not running ones, normalize)"
    if bn.running_mean is None or bn.running_var is None:
        return "no running statistics (track_running_stats=False): eval normalizes by the batch's"
    if calls[node.target] > 1:
        return f"called {calls[node.target]} times in the forward"
    if len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], torch.fx.Node):
        return "its input is not a single traced value"
    source = node.args[0]
    layer = modules.get(source.target) if source.op == "call_module" else None
    if not isinstance(layer, LAYERS):
        what = source.target if source.op != "call_function" else getattr(source.target, "__name__", source.target)
        return f"its input is {source.op} {what!r}, not a Conv1d, Conv2d, Conv3d or Linear submodule"
    if len(source.users) > 1:
        return f"the output of {source.target!r} is also read elsewhere ({len(source.users)} readers)"
    if calls[source.target] > 1:
        return f"{source.target!r} is called {calls[source.target]} times in the forward"
    out_features = layer.out_features if isinstance(layer, nn.Linear) else layer.out_channels
    if out_features != bn.num_features:
        return f"{source.target!r} has {out_features} output channels, the BatchNorm {bn.num_features} features"
    norm = next((norm for conv, norm in CONV_NORMS.items() if isinstance(layer, conv)), None)
    if norm is not None:
        return None if isinstance(bn, norm) else f"a {type(layer).__name__} followed by a {type(bn).__name__}"
    if isinstance(bn, nn.BatchNorm3d):
        return f"a {type(layer).__name__} followed by a BatchNorm3d"
    rank = 3 if isinstance(layer, nn.Conv1d) else 2
    if not shapes_known:
        return (f"the rank of {source.target!r}'s output is unknown: pass example inputs to fold "
                "a Conv1d or Linear into a BatchNorm1d")
    meta = source.meta.get("tensor_meta")
    if meta is None or len(meta.shape) != rank:
        got = "unknown" if meta is None else f"{len(meta.shape)}-D"
        return f"{source.target!r}'s output is {got} in the example, not {rank}-D (channels on dim 1)"
    return None


def _altered(node, modules, names: dict[int, list[str]], read: set) -> str | None:
    """Why folding would change more than this pair computes: a layer tensor that is
    also another module's (tied) or read directly by the forward, a parametrized
    weight (``weight_norm``, ``spectral_norm``: the stored tensor is not the weight),
    or hooks on either module (a BatchNorm's would be dropped with it, a layer's
    would see the folded weights)."""
    layer_name = node.args[0].target
    layer, bn = modules[layer_name], modules[node.target]
    if torch.nn.utils.parametrize.is_parametrized(layer):
        return f"{layer_name!r} is parametrized (its weight is computed, not stored)"
    for name, module in ((layer_name, layer), (node.target, bn)):
        hooks = [kind for kind in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                                   "_backward_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks")
                 if getattr(module, kind, None)]
        if hooks:
            return f"{name!r} has hooks ({', '.join(h.strip('_') for h in hooks)}), which folding would bypass"
    for attribute in ("weight", "bias"):
        tensor = getattr(layer, attribute, None)
        if tensor is None:
            continue
        owners = names.get(id(tensor), [])
        if len(owners) > 1:
            return f"{layer_name}.{attribute} is shared ({', '.join(owners)}): folding would change its other uses"
        if any(target in read for target in owners):
            return f"the forward reads {owners[0]} directly: folding would change that use"
    return None


@torch.no_grad()
def _fold_into(layer: nn.Module, bn: nn.Module) -> None:
    """W' = W * s, b' = (b - running_mean) * s + beta, in float64."""
    weight = layer.weight
    gamma = bn.weight.double() if bn.weight is not None else torch.ones(bn.num_features, dtype=torch.float64)
    beta = bn.bias.double() if bn.bias is not None else torch.zeros(bn.num_features, dtype=torch.float64)
    scale = gamma.to(weight.device) / torch.sqrt(bn.running_var.double() + bn.eps)
    bias = layer.bias.double() if layer.bias is not None else torch.zeros_like(scale)
    new_bias = (bias - bn.running_mean.double()) * scale + beta.to(scale.device)
    shape = (-1,) + (1,) * (weight.dim() - 1)
    layer.weight.copy_((weight.double() * scale.view(shape)).to(weight.dtype))
    if layer.bias is not None:
        layer.bias.copy_(new_bias.to(layer.bias.dtype))
    else:
        layer.bias = nn.Parameter(new_bias.to(weight.dtype), requires_grad=weight.requires_grad)
