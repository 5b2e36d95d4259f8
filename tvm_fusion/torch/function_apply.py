"""``Function.apply`` for the eager training path, without torch's Python layer.

``torch.autograd.Function.apply`` is a Python classmethod around the C++ apply that
builds the graph node. Outside functorch transforms (``vmap``, ``grad``) it only
passes each argument through ``torch._C._functorch.unwrap_if_dead`` (a generator over
all eight arguments) and calls the C++ apply. On this project's CI machine that layer
cost several us a call (timed by hand, not written to the CSV: about a quarter of
cross entropy's apply), next to a CPU kernel launch of a few us.

:func:`apply` unwraps the first argument, the tensor the gradient is for, and calls
the C++ apply. A dead functorch wrapper among the other
arguments (a tensor that escaped a finished ``vjp``) reaches the kernel's launch,
which refuses it with an error, not a wrong result. Under a functorch transform, or
on a torch without these internals, it is ``function.apply`` itself.

:func:`first_order` marks what a backward returns as having no derivative of its own:
the kernels give a gradient, not a graph of it. Under ``create_graph=True`` (a
gradient penalty, a Hessian-vector product) a gradient without a graph would make
every second-order term through the op silently zero; marked, differentiating it
raises an error that names the op instead.
"""

from typing import Any

import torch

try:
    _unwrap_if_dead = torch._C._functorch.unwrap_if_dead
    _transforms_active = torch._C._are_functorch_transforms_active
    _CPP_APPLY = True
except AttributeError:  # pragma: no cover - a torch without them: torch's own apply
    _CPP_APPLY = False


def first_order(op: str, grads: tuple) -> tuple:
    """A backward's ``grads`` (tensors or None), each tensor given a node that raises
    when it is differentiated, where the backward runs with ``create_graph=True``
    (grad mode on); as they are otherwise (grad mode is off in a plain backward)."""
    if not torch.is_grad_enabled():
        return grads
    message = (f"{op} has no second derivative: its gradient comes from a kernel, not from differentiable "
               "torch operations, so create_graph=True cannot differentiate it again; use the torch.nn."
               "functional form where a second derivative is needed").encode()
    error = torch._C._functions.DelayedError(message, len(grads))
    marked = error(*[None if g is None else g.detach().requires_grad_() for g in grads])
    return marked if isinstance(marked, tuple) else (marked,)


def apply(function: type[torch.autograd.Function], first: torch.Tensor, *rest: Any) -> Any:
    """``function.apply(first, *rest)`` (positional arguments only)."""
    if not _CPP_APPLY or _transforms_active():
        return function.apply(first, *rest)
    return super(torch.autograd.Function, function).apply(_unwrap_if_dead(first), *rest)
